"""cli layer of mlxppd (see DESIGN.md)."""
