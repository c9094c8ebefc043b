"""The pipeline at run time: stage worker, coordinator, backends, loading.

See docs/architecture.md for how it fits with the rest.
"""
