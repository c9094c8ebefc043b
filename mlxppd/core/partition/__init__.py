"""Which layers go where: the balancer, its search, sizes, quality report.

See docs/architecture.md for how it fits with the rest.
"""
