"""Model profiles made up from per-layer weights, for the partitioner's tests."""

from __future__ import annotations

from collections.abc import Sequence

from mlxppd.core.layer_ranges import AdjacencyGroup
from mlxppd.core.profile.model import ModelProfile


def synthetic(
    weights: Sequence[int],
    embedding: int = 0,
    lm_head: int = 0,
    shared: int = 0,
    groups: Sequence[AdjacencyGroup] = (),
) -> ModelProfile:
    """A profile of ``len(weights)`` blocks of those byte sizes, with those ends and groups."""
    return ModelProfile(
        model_type="synthetic",
        family="synthetic",
        layer_bytes=tuple(weights),
        layer_kinds=("block",) * len(weights),
        embedding_bytes=embedding,
        lm_head_bytes=lm_head,
        shared_end_bytes=shared,
        adjacency_groups=tuple(groups),
    )
