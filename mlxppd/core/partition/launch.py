"""Pre-launch warnings: everything an operator should hear about a plan before it serves.

One sentence each, logged by ``mlxppd serve``'s coordinator and the agent's at start, carried
in ``mlxppctl status`` (the coordinator's ``warnings``) and printed by ``serve --pp-auto N
--dry-run``. They are the plan's own warnings (profile caveats, imbalance and what forces it, a
stage over its budget; a stage boundary inside a KV-shared group is refused outright, never a
warning) plus two about the deployment: more than two stages over TCP, and a model family
outside the best-tested set. See docs/partitioning.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxppd.core.config.cluster import ClusterConfig
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.partition.plan import PartitionPlan, balance_layers, plan_layers
from mlxppd.core.profile.model import ModelProfile

__all__ = [
    "BEST_TESTED_FAMILIES",
    "TCP_STAGE_LIMIT",
    "cluster_partition_plan",
    "launch_warnings",
]

#: the model_types an operator can run with the most confidence: llama (the embedded model's
#: family, served by every end-to-end test), mistral (the same executor) and qwen3 (plain
#: dense); every other family's parity with mlx-lm is checked on tiny random-weight fixtures only
BEST_TESTED_FAMILIES = frozenset({"llama", "mistral", "qwen3"})

#: stages over plain TCP beyond which each extra hop's latency is worth a warning
TCP_STAGE_LIMIT = 2


def launch_warnings(
    plan: PartitionPlan, transport_backend: str, family: str | None = None
) -> tuple[str, ...]:
    """Every pre-launch warning of ``plan`` served over ``transport_backend``, one sentence
    each; ``family`` is the model's ``model_type`` (default: the plan's profile's)."""
    out = list(plan.warnings)
    stages = len(plan.stages)
    if transport_backend == "tcp" and stages > TCP_STAGE_LIMIT:
        out.append(
            f"{stages} stages over TCP: every token crosses {stages - 1} stage-to-stage hops "
            "and each extra TCP hop adds latency; use transport_backend thunderbolt or rdma "
            f"where the hosts have it, or at most {TCP_STAGE_LIMIT} stages"
        )
    name = family if family is not None else plan.profile.model_type
    if name not in BEST_TESTED_FAMILIES:
        tested = ", ".join(sorted(BEST_TESTED_FAMILIES))
        out.append(
            f"model family {name or 'unknown'!r} is outside the best-tested set ({tested}): "
            "its pipeline parity with mlx-lm is tested on small random-weight fixtures only"
        )
    return tuple(out)


def cluster_partition_plan(
    cluster: ClusterConfig,
    profile: ModelProfile,
    ranges: Sequence[LayerRange] | None = None,
) -> PartitionPlan:
    """The plan behind a cluster's layer ranges (``ranges``, default the file's), with its
    warnings: the balancer's when ``[cluster] layers`` is unset and it gives these ranges (as
    ``cluster_layer_plan`` does), the manual plan's otherwise (a file's or a repartition's)."""
    by_stage: dict[int, str] = {}
    for node in cluster.stage_nodes():
        if node.stage is not None:
            by_stage.setdefault(node.stage, node.id)
    count = cluster.cluster.pipeline_parallel_size if ranges is None else len(ranges)
    ids = [by_stage.get(i, f"stage-{i}") for i in range(count)]
    if cluster.cluster.layers is None:
        plan = balance_layers(profile, count, device_ids=ids)
        if ranges is None or plan.ranges == tuple(ranges):
            return plan
    chosen = cluster.layer_plan(profile.num_layers) if ranges is None else ranges
    return plan_layers(profile, chosen, device_ids=ids)
