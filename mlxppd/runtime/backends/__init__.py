"""What the HTTP layer serves from: the generation backend contract and the in-process backend
(every stage in this process). The coordinator is the other implementation.
"""
