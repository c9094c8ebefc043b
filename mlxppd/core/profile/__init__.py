"""What each layer weighs: model profiles and the family table.

See docs/architecture.md for how it fits with the rest.
"""
