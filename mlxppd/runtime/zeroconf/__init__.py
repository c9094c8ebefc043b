"""Zero-config bring-up at run time: discovery, offers, activation.

See docs/architecture.md for how it fits with the rest.
"""
