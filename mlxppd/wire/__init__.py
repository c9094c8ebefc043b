"""wire layer of mlxppd (see DESIGN.md)."""
