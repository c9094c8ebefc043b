"""What each tensor-parallel rank of a stage holds (pure): the plan's blocks split over the
ranks, the ends whole.

mlx-lm's ``shard()`` splits every attention and MLP projection of a block evenly over the
ranks (``mlxppd/engine/tensor_parallel.py`` applies it to a stage's layers); it leaves the
embedding and the output head whole on every rank of the stages that hold them. A block's
norms are not split either, but they weigh a few KiB, so a block counts ``1 / tp`` of its bytes.
"""

from __future__ import annotations

from mlxppd.core.partition.plan import PartitionPlan


def rank_bytes(plan: PartitionPlan, tp: int) -> tuple[int, ...]:
    """Estimated bytes one rank of each stage holds when stages are ``tp`` ranks wide."""
    if tp < 1:
        raise ValueError("a stage has at least one rank")
    out = []
    for stage in plan.stages:
        r = stage.layer_range
        blocks = sum(plan.profile.layer_bytes[r.start : r.end])
        ends = stage.estimated_memory_bytes - blocks
        out.append(-(-blocks // tp) + ends)
    return tuple(out)
