"""Typed messages between nodes: data plane, control plane, assignment.

See docs/architecture.md for how it fits with the rest.
"""
