"""Placing a model's blocks on pipeline stages: the balancer, manual-plan validation, budgets.

``balance_layers`` finds contiguous layer ranges that minimise the largest stage load (stage 0
also holds the embedding, the last stage the output head), subject to per-stage memory budgets
and the model's adjacency groups. The result is optimal, not a greedy approximation (the search
is in ``partition.search``); among optimal plans it takes the one whose lightest stage is
heaviest. Budgets that cannot be met are an error naming the stages that stay short and by how
much. ``plan_layers`` / ``plan_from_pp_layers`` check a manual ``--pp-layers`` split instead.
Both attach warnings: profile caveats, stages over budget, and imbalance beyond ~1.5x with what
forces it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import (
    AdjacencyGroup,
    LayerRange,
    format_pp_layers,
    parse_pp_layers,
)
from mlxppd.core.partition.search import (
    SplitSearch,
    check_stage_count,
    least_overflow_bounds,
    optimal_bounds,
)
from mlxppd.core.partition.sizes import format_bytes, parse_byte_size, parse_stage_memory
from mlxppd.core.profile.model import ModelProfile

__all__ = [
    "IMBALANCE_WARNING_RATIO",
    "PartitionPlan",
    "StageAssignment",
    "balance_layers",
    "format_bytes",
    "parse_byte_size",
    "parse_stage_memory",
    "plan_from_pp_layers",
    "plan_layers",
]

#: max/min stage load above which a plan carries a throughput warning
IMBALANCE_WARNING_RATIO = 1.5

_STAGE_MEMORY = "--stage-memory"

# -- plans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageAssignment:
    """One stage of a plan: its layers, which ends it holds, and what it weighs."""

    stage_index: int
    layer_range: LayerRange
    has_embedding: bool
    has_lm_head: bool
    estimated_memory_bytes: int
    budget_bytes: int | None = None
    device_id: str = ""

    @property
    def shortfall_bytes(self) -> int:
        """Bytes over budget (0 when it fits or has no budget)."""
        if self.budget_bytes is None:
            return 0
        return max(0, self.estimated_memory_bytes - self.budget_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "stage_index": self.stage_index,
            "layer_range": [self.layer_range.start, self.layer_range.end],
            "has_embedding": self.has_embedding,
            "has_lm_head": self.has_lm_head,
            "estimated_memory_bytes": self.estimated_memory_bytes,
            "budget_bytes": self.budget_bytes,
        }


@dataclass(frozen=True)
class PartitionPlan:
    """Stages in order, with the profile they were planned from and the caveats found."""

    profile: ModelProfile
    stages: tuple[StageAssignment, ...]
    warnings: tuple[str, ...] = ()
    #: True for a balancer plan, False for a --pp-layers plan
    auto: bool = True

    @property
    def ranges(self) -> tuple[LayerRange, ...]:
        return tuple(s.layer_range for s in self.stages)

    @property
    def max_bytes(self) -> int:
        return max(s.estimated_memory_bytes for s in self.stages)

    @property
    def min_bytes(self) -> int:
        return min(s.estimated_memory_bytes for s in self.stages)

    @property
    def imbalance(self) -> float:
        """Largest over smallest stage load (1.0: perfectly even)."""
        return self.max_bytes / max(self.min_bytes, 1)

    def to_json(self) -> dict[str, Any]:
        """The ``mlxppctl plan --json`` document."""
        return {
            "stages": [s.to_json() for s in self.stages],
            "layer_bytes": list(self.profile.layer_bytes),
            "embedding_bytes": self.profile.embedding_bytes,
            "lm_head_bytes": self.profile.lm_head_bytes,
            "adjacency_groups": [[g.first, g.last] for g in self.profile.adjacency_groups],
            "imbalance": round(self.imbalance, 4),
            "warnings": list(self.warnings),
        }


def _assignments(
    profile: ModelProfile,
    ranges: Sequence[LayerRange],
    budgets: Sequence[int | None],
    device_ids: Sequence[str] | None,
) -> tuple[StageAssignment, ...]:
    last = len(ranges) - 1
    return tuple(
        StageAssignment(
            stage_index=i,
            layer_range=r,
            has_embedding=i == 0,
            has_lm_head=i == last,
            estimated_memory_bytes=profile.stage_bytes(r, first=i == 0, last=i == last),
            budget_bytes=budgets[i],
            device_id=device_ids[i] if device_ids else f"local-stage-{i}",
        )
        for i, r in enumerate(ranges)
    )


# -- balancing -------------------------------------------------------------------------------


def _describe_stage(s: StageAssignment) -> str:
    ends = [("the embedding", s.has_embedding), ("the output head", s.has_lm_head)]
    held = [name for name, held in ends if held]
    r = s.layer_range
    layers = f"layers {r}" if r.count > 1 else f"layer {r.start}"
    return " and ".join([*held, layers]) if len(held) < 2 else f"{held[0]}, {held[1]} and {layers}"


def _infeasible(
    profile: ModelProfile, problem: SplitSearch, budgets: Sequence[int | None]
) -> ConfigurationError:
    """Say which stages stay short, by how much, in the plan needing the least extra memory."""
    best = least_overflow_bounds(problem, budgets)
    ranges = [LayerRange(a, b) for a, b in zip(best, best[1:], strict=False)]
    stages = _assignments(profile, ranges, budgets, None)
    short = sorted((s for s in stages if s.shortfall_bytes), key=lambda s: -s.shortfall_bytes)
    worst = short[0]
    assert worst.budget_bytes is not None
    others = "".join(
        f", stage {s.stage_index} by {format_bytes(s.shortfall_bytes)}" for s in short[1:]
    )
    known = [b for b in budgets if b is not None]
    needed = sum(profile.layer_bytes) + sum(problem.extras)
    summed = ""
    if len(known) == len(budgets) and sum(known) < needed:
        summed = (
            f" (together {format_bytes(sum(known))}; {len(stages)} stages need at least "
            f"{format_bytes(needed)})"
        )
    return ConfigurationError(
        f"the model does not fit the stage memory budgets{summed}: even the best plan, "
        f"{format_pp_layers(ranges)}, leaves stage {worst.stage_index} short by "
        f"{format_bytes(worst.shortfall_bytes)} ({worst.shortfall_bytes} bytes; it needs "
        f"{format_bytes(worst.estimated_memory_bytes)} for {_describe_stage(worst)} and has "
        f"{format_bytes(worst.budget_bytes)}){others}; give "
        f"{'that stage' if len(short) == 1 else 'those stages'} more memory, add stages with "
        "--pp-size, or use a more strongly quantized model",
        source=_STAGE_MEMORY,
    )


def _optimal_bounds(
    profile: ModelProfile,
    num_stages: int,
    budgets: Sequence[int | None],
    groups: Sequence[AdjacencyGroup],
) -> list[int]:
    problem = SplitSearch(profile, num_stages, groups)
    check_stage_count(profile, num_stages, problem)
    bounds = optimal_bounds(problem, budgets)
    if bounds is None:
        raise _infeasible(profile, problem, budgets)
    return bounds


def _normalise_budgets(budgets: Sequence[int | None] | None, num_stages: int) -> list[int | None]:
    if budgets is None:
        return [None] * num_stages
    if len(budgets) != num_stages:
        raise ConfigurationError(
            f"gives {len(budgets)} budgets for {num_stages} stages", source=_STAGE_MEMORY
        )
    return list(budgets)


def balance_layers(
    profile: ModelProfile,
    num_stages: int,
    budgets: Sequence[int | None] | None = None,
    *,
    device_ids: Sequence[str] | None = None,
) -> PartitionPlan:
    """The optimal plan: contiguous ranges minimising the largest stage load.

    ``budgets`` (bytes per stage, None for unlimited) bound each stage's load; no stage starts
    inside one of the profile's adjacency groups. Raises ConfigurationError when the stage count
    is impossible or the budgets cannot be met (naming the short stage and by how much).
    """
    caps = _normalise_budgets(budgets, num_stages)
    bounds = _optimal_bounds(profile, num_stages, caps, profile.adjacency_groups)
    ranges = [LayerRange(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    stages = _assignments(profile, ranges, caps, device_ids)
    plan = PartitionPlan(profile, stages, auto=True)
    return PartitionPlan(profile, stages, _auto_warnings(plan, caps), auto=True)


def balance_compute(profile: ModelProfile, num_stages: int) -> tuple[LayerRange, ...]:
    """Ranges that balance each stage's time per token, for stages that share one host's
    memory (a local cluster), where bytes need no balancing.

    A stage's time is about the weights it reads: its layers', and on the last stage its
    output head's, which every decode step reads and no prefill chunk does (it is skipped
    there), so it counts half. The embedding is a lookup of one row per token: it counts
    nothing. On the embedded model this gives 17 + 13 layers instead of 15 + 15, whose last
    stage took 1.4x as long per decode pass as the first (bench/pipeline.py's trace)."""
    weighted = replace(
        profile, embedding_bytes=0, lm_head_bytes=profile.lm_head_bytes // 2, shared_end_bytes=0
    )
    return tuple(balance_layers(weighted, num_stages).ranges)


def plan_layers(
    profile: ModelProfile,
    ranges: Sequence[LayerRange],
    budgets: Sequence[int | None] | None = None,
    *,
    device_ids: Sequence[str] | None = None,
) -> PartitionPlan:
    """A plan from explicit ranges (already shape-checked), with budget and balance warnings."""
    caps = _normalise_budgets(budgets, len(ranges))
    stages = _assignments(profile, ranges, caps, device_ids)
    plan = PartitionPlan(profile, stages, auto=False)
    return PartitionPlan(profile, stages, _manual_warnings(plan, caps), auto=False)


def plan_from_pp_layers(
    profile: ModelProfile,
    text: str,
    budgets: Sequence[int | None] | None = None,
    *,
    device_ids: Sequence[str] | None = None,
) -> PartitionPlan:
    """Parse and validate ``--pp-layers`` against the profile (bounds, tiling, adjacency)."""
    ranges = parse_pp_layers(text, profile.num_layers, profile.adjacency_groups)
    return plan_layers(profile, ranges, budgets, device_ids=device_ids)


# -- warnings --------------------------------------------------------------------------------


def _common_warnings(plan: PartitionPlan) -> list[str]:
    out = list(plan.profile.notes)
    if plan.profile.pipeline_refusal and len(plan.stages) > 1:
        out.append(plan.profile.pipeline_refusal)
    return out


def _merged_groups(groups: Sequence[AdjacencyGroup]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for g in sorted(groups):
        if spans and g.first <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], g.last))
        else:
            spans.append((g.first, g.last))
    return spans


def _range_text(plan: PartitionPlan) -> str:
    return (
        f"stage byte loads range from {plan.min_bytes} to {plan.max_bytes} "
        f"({plan.imbalance:.2f}x), which may hurt throughput"
    )


def _imbalance_of(
    profile: ModelProfile,
    num_stages: int,
    caps: Sequence[int | None],
    groups: Sequence[AdjacencyGroup],
) -> float | None:
    """Imbalance of the optimal plan under other constraints (None: no plan exists)."""
    try:
        bounds = _optimal_bounds(profile, num_stages, caps, groups)
    except ConfigurationError:
        return None
    loads = SplitSearch(profile, num_stages, groups).loads(bounds)
    return max(loads) / max(min(loads), 1)


def _group_sentence(plan: PartitionPlan) -> str:
    """'Heaviest stage 1 carries adjacency group 0..7 (why)' for the stage holding the widest
    group span (docs/partitioning.md's wording when that stage is also the heaviest)."""
    groups = plan.profile.adjacency_groups
    heaviest = max(plan.stages, key=lambda s: s.estimated_memory_bytes)
    first, last = max(_merged_groups(groups), key=lambda sp: sp[1] - sp[0])
    holder = next(s for s in plan.stages if first in s.layer_range)
    inside = [g for g in groups if first <= g.first and g.last <= last]
    why = (
        inside[0].reason
        if len(inside) == 1 and inside[0].reason
        else f"{len(inside)} source/consumer pairs that must share a stage"
    )
    who = "Heaviest stage" if holder is heaviest else "Stage"
    return f"{who} {holder.stage_index} carries adjacency group {first}..{last} ({why})."


def _auto_warnings(plan: PartitionPlan, caps: Sequence[int | None]) -> tuple[str, ...]:
    """Profile notes, plus a hint when the plan is uneven beyond ~1.5x, saying what forces it:
    adjacency groups, budgets (each judged by the optimum without it), or block granularity."""
    out = _common_warnings(plan)
    if plan.imbalance <= IMBALANCE_WARNING_RATIO:
        return tuple(out)
    profile, k = plan.profile, len(plan.stages)
    groups = profile.adjacency_groups
    causes = []
    if groups:
        free = _imbalance_of(profile, k, caps, ())
        if free is not None and free < plan.imbalance:
            causes.append(_group_sentence(plan))
    if any(c is not None for c in caps):
        unbudgeted = _imbalance_of(profile, k, [None] * k, groups)
        if unbudgeted is not None and unbudgeted < plan.imbalance:
            causes.append(
                "The stage memory budgets force it: tighter stages take fewer bytes and the "
                "rest spills onto the roomier ones."
            )
    if not causes:
        heaviest = max(plan.stages, key=lambda s: s.estimated_memory_bytes)
        causes.append(
            f"No split of these blocks does better: heaviest stage {heaviest.stage_index} "
            f"holds {_describe_stage(heaviest)}; fewer stages would even it out."
        )
    out.append(
        f"pipeline auto-partition produced an imbalanced plan: {_range_text(plan)}. "
        + " ".join(causes)
        + " This is a hint to rebalance hardware, not an error."
    )
    return tuple(out)


def _manual_warnings(plan: PartitionPlan, caps: Sequence[int | None]) -> tuple[str, ...]:
    out = _common_warnings(plan)
    for s in plan.stages:
        if s.shortfall_bytes and s.budget_bytes is not None:
            out.append(
                f"stage {s.stage_index} needs {format_bytes(s.estimated_memory_bytes)} for "
                f"{_describe_stage(s)} but its budget is {format_bytes(s.budget_bytes)} "
                f"(short by {format_bytes(s.shortfall_bytes)}); it will not fit"
            )
    if plan.imbalance > IMBALANCE_WARNING_RATIO:
        text = f"the --pp-layers plan is imbalanced: {_range_text(plan)}"
        try:
            auto = balance_layers(plan.profile, len(plan.stages), caps)
        except ConfigurationError:
            auto = None
        if auto is not None and auto.imbalance < plan.imbalance:
            text += (
                f"; the auto partitioner would use {format_pp_layers(auto.ranges)} "
                f"({auto.imbalance:.2f}x)"
            )
        out.append(text)
    return tuple(out)
