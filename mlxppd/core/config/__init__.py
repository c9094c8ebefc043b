"""Configuration: the cluster TOML, this host's settings, addresses, rendering.

See docs/architecture.md for how it fits with the rest.
"""
