"""mlxpp: pipeline-parallel serving of MLX language models across several hosts."""

__version__ = "0.1.0"
