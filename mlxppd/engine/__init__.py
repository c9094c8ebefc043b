"""engine layer of mlxppd (see docs/architecture.md)."""
