"""The agent's decisions: desired state, reconcile plan, elastic machine, health.

See docs/architecture.md for how it fits with the rest.
"""
