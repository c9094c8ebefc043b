"""PartitionQualityReport: estimated against loaded bytes per stage (docs/partitioning.md)."""

from __future__ import annotations

import pytest

from mlxppd.core.layer_ranges import AdjacencyGroup, LayerRange
from mlxppd.core.partition.plan import balance_layers
from mlxppd.core.partition.quality import PartitionQualityReport, StageQuality, quality_report
from tests.support.synthetic_profiles import synthetic

SPEC_EXAMPLE = PartitionQualityReport(
    stages=(
        StageQuality(0, "local-stage-0", LayerRange(0, 13), 12_500_000),
        StageQuality(1, "local-stage-1", LayerRange(13, 26), 11_900_000),
    )
)


def test_before_loading_the_report_reads_like_the_spec() -> None:
    assert SPEC_EXAMPLE.format() == (
        "pipeline partition quality: 2 stages, max=12500000 bytes, min=11900000 bytes, "
        "imbalance=1.05x\n"
        "  stage 0 device 'local-stage-0' layers=13 estimated=12500000 actual=unknown\n"
        "  stage 1 device 'local-stage-1' layers=13 estimated=11900000 actual=unknown"
    )
    assert SPEC_EXAMPLE.max_abs_drift is None


def test_loaded_bytes_add_the_actual_column_and_the_drift() -> None:
    report = SPEC_EXAMPLE.with_actual([12_400_000, 12_019_000])
    lines = report.format().splitlines()
    assert lines[1].endswith("estimated=12500000 actual=12400000 drift=-0.80%")
    assert lines[2].endswith("estimated=11900000 actual=12019000 drift=+1.00%")
    assert report.max_abs_drift == pytest.approx(0.01)
    # The estimate the plan was made with does not change.
    assert (report.max_bytes, report.min_bytes) == (12_500_000, 11_900_000)


def test_actual_sizes_must_cover_every_stage() -> None:
    with pytest.raises(ValueError, match="1 actual sizes for 2 stages"):
        SPEC_EXAMPLE.with_actual([1])


def test_a_plan_report_carries_its_warnings() -> None:
    profile = synthetic([10] * 10, groups=[AdjacencyGroup(2, 7, "synthetic forced-join")])
    report = quality_report(balance_layers(profile, 2))
    assert report.imbalance == pytest.approx(4.0)
    last = report.format().splitlines()[-1]
    assert last.startswith("  warning: pipeline auto-partition produced an imbalanced plan")
    assert [s.device_id for s in report.stages] == ["local-stage-0", "local-stage-1"]
