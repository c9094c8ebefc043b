"""How good a plan is: the quality report (estimated against actual bytes) and the preview.

Built from a plan before anything is loaded (``actual`` unknown), then completed with the bytes
each stage really holds once its weights are in memory, so operators see when the estimator
drifts from reality. ``format()`` is the block ``--verbose`` logs once at start-up::

    pipeline partition quality: 2 stages, max=12500000 bytes, min=11900000 bytes, imbalance=1.05x
      stage 0 device 'local-stage-0' layers=13 estimated=12500000 actual=unknown
      stage 1 device 'local-stage-1' layers=13 estimated=11900000 actual=11950000 drift=+0.42%

``format_plan`` renders the "shard plan preview" (``mlxppctl plan``): per stage its layers,
estimated bytes and a memory-fit bar against its budget, then the warnings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from mlxppd.core.layer_ranges import LayerRange, format_pp_layers
from mlxppd.core.partition.plan import PartitionPlan, format_bytes

__all__ = ["PartitionQualityReport", "StageQuality", "format_plan", "quality_report"]


@dataclass(frozen=True)
class StageQuality:
    stage_index: int
    device_id: str
    layer_range: LayerRange
    estimated_bytes: int
    #: parameter bytes the stage holds once loaded; None until then
    actual_bytes: int | None = None

    @property
    def drift(self) -> float | None:
        """(actual - estimated) / estimated, or None before loading."""
        if self.actual_bytes is None or self.estimated_bytes == 0:
            return None
        return (self.actual_bytes - self.estimated_bytes) / self.estimated_bytes

    def line(self) -> str:
        actual = "unknown" if self.actual_bytes is None else str(self.actual_bytes)
        text = (
            f"stage {self.stage_index} device '{self.device_id}' layers={self.layer_range.count} "
            f"estimated={self.estimated_bytes} actual={actual}"
        )
        drift = self.drift
        return text if drift is None else f"{text} drift={drift:+.2%}"


@dataclass(frozen=True)
class PartitionQualityReport:
    stages: tuple[StageQuality, ...]
    warnings: tuple[str, ...] = ()

    @property
    def max_bytes(self) -> int:
        return max(s.estimated_bytes for s in self.stages)

    @property
    def min_bytes(self) -> int:
        return min(s.estimated_bytes for s in self.stages)

    @property
    def imbalance(self) -> float:
        """Largest over smallest estimated stage load."""
        return self.max_bytes / max(self.min_bytes, 1)

    @property
    def max_abs_drift(self) -> float | None:
        drifts = [abs(d) for s in self.stages if (d := s.drift) is not None]
        return max(drifts) if drifts else None

    def with_actual(self, actual_bytes: Sequence[int]) -> PartitionQualityReport:
        """The same report with each stage's loaded parameter bytes filled in."""
        if len(actual_bytes) != len(self.stages):
            raise ValueError(f"{len(actual_bytes)} actual sizes for {len(self.stages)} stages")
        stages = tuple(
            replace(s, actual_bytes=int(a)) for s, a in zip(self.stages, actual_bytes, strict=True)
        )
        return replace(self, stages=stages)

    def format(self) -> str:
        """The multi-line block docs/partitioning.md shows, warnings last."""
        lines = [
            f"pipeline partition quality: {len(self.stages)} stages, max={self.max_bytes} bytes, "
            f"min={self.min_bytes} bytes, imbalance={self.imbalance:.2f}x"
        ]
        lines += [f"  {s.line()}" for s in self.stages]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def quality_report(plan: PartitionPlan) -> PartitionQualityReport:
    """The report of a plan before loading (every ``actual`` unknown)."""
    return PartitionQualityReport(
        stages=tuple(
            StageQuality(
                stage_index=s.stage_index,
                device_id=s.device_id,
                layer_range=s.layer_range,
                estimated_bytes=s.estimated_memory_bytes,
            )
            for s in plan.stages
        ),
        warnings=plan.warnings,
    )


# -- the shard plan preview ------------------------------------------------------------------

_BAR_WIDTH = 20


def _fit(estimated: int, budget: int | None, heaviest: int) -> str:
    """'[#####...............]  24.0% of 16.0 GiB': the stage's share of its budget."""
    base = budget if budget is not None else heaviest
    share = estimated / max(base, 1)
    filled = min(_BAR_WIDTH, round(share * _BAR_WIDTH))
    bar = "[" + "#" * filled + "." * (_BAR_WIDTH - filled) + "]"
    if budget is None:
        return f"{bar} {share:6.1%} of the heaviest stage (no budget)"
    if estimated > budget:
        return f"{bar}! {share:6.1%} OVER by {format_bytes(estimated - budget)}"
    return f"{bar} {share:6.1%} of {format_bytes(budget)}"


def format_plan(plan: PartitionPlan, model: str) -> str:
    """The shard plan preview: one row per stage with a memory-fit bar, then the warnings."""
    profile = plan.profile
    how = "auto, balanced parameter bytes" if plan.auto else "manual --pp-layers"
    total = sum(s.estimated_memory_bytes for s in plan.stages)
    lines = [
        f"model     {model}",
        f"          {profile.family or profile.model_type}, {profile.num_layers} layers; "
        f"{profile.storage}",
        f"plan      {how}: {len(plan.stages)} stage(s), --pp-layers "
        f"{format_pp_layers(plan.ranges)}",
        f"memory    {format_bytes(total)} over all stages; imbalance {plan.imbalance:.2f}x "
        "(largest / smallest stage)",
        "",
    ]
    rows = [("stage", "layers", "count", "holds", "estimated", "budget", "memory fit")]
    for s in plan.stages:
        holds = " + ".join(
            [p for p, on in (("embedding", s.has_embedding), ("lm_head", s.has_lm_head)) if on]
        )
        rows.append(
            (
                str(s.stage_index),
                str(s.layer_range),
                str(s.layer_range.count),
                holds or "-",
                format_bytes(s.estimated_memory_bytes),
                "-" if s.budget_bytes is None else format_bytes(s.budget_bytes),
                _fit(s.estimated_memory_bytes, s.budget_bytes, plan.max_bytes),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {0, 2, 4, 5}
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines += ["", "blocks"]
    lines += [
        f"  stage {s.stage_index}: {profile.kind_summary(s.layer_range)}" for s in plan.stages
    ]
    if profile.adjacency_groups:
        shown = ", ".join(str(g) for g in profile.adjacency_groups[:8])
        more = len(profile.adjacency_groups) - 8
        lines += [
            "",
            "adjacency groups (source..consumer; no stage may start inside one)",
            f"  {shown}" + (f", and {more} more" if more > 0 else ""),
        ]
    lines += ["", "warnings" if plan.warnings else "warnings: none"]
    lines += [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines)
