"""core layer of mlxppd (see DESIGN.md)."""
