"""runtime layer of mlxppd (see DESIGN.md)."""
