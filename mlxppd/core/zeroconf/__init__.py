"""Zero-config bring-up: from discovered peers to a cluster TOML.

See docs/architecture.md for how it fits with the rest.
"""
