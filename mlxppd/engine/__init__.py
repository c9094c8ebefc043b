"""engine layer of mlxppd (see DESIGN.md)."""
