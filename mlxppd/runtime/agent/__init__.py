"""The mlxppd agent: its loop, its actions, its status document.

See docs/architecture.md for how it fits with the rest.
"""
