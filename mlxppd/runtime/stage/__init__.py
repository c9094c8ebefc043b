"""The stage side of the pipeline: a stage worker serving one layer range, its control plane
(one handler per command), its compute loop and work queue, loading, tensor-parallel ranks.

See docs/architecture.md for how its parts fit.
"""
