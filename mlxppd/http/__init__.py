"""http layer of mlxppd (see DESIGN.md)."""
