"""The process: event loop, mlx thread, sd_notify, logging, atomic files.

See docs/architecture.md for how it fits with the rest.
"""
