"""Prometheus metrics and Perfetto traces.

See docs/architecture.md for how it fits with the rest.
"""
