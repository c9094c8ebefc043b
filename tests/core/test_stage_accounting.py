"""Stage time accounting: busy, active and bubble fractions; latency histograms."""

from __future__ import annotations

import pytest

from mlxppd.core.stage_accounting import ActivityClock, LatencyHistogram, fractions


def test_bubble_is_active_time_not_spent_computing() -> None:
    clock = ActivityClock(started=0.0)
    before = clock.snapshot(0.0)
    clock.set_active(2, now=1.0)  # work arrives at t=1
    clock.busy(3.0)  # computes 3 s of the next 4
    clock.set_active(0, now=5.0)
    after = clock.snapshot(10.0)
    assert after == {"busy_s": 3.0, "active_s": 4.0, "wall_s": 10.0}
    busy, bubble = fractions(before, after)
    assert busy == pytest.approx(0.3)
    assert bubble == pytest.approx(0.25)


def test_an_idle_stage_has_no_bubble() -> None:
    clock = ActivityClock(started=0.0)
    assert fractions(clock.snapshot(0.0), clock.snapshot(5.0)) == (0.0, 0.0)


def test_active_time_counts_up_to_now_while_sequences_are_held() -> None:
    clock = ActivityClock(started=0.0)
    clock.set_active(1, now=2.0)
    clock.set_active(3, now=3.0)  # still active: no new start
    assert clock.snapshot(6.0)["active_s"] == 4.0


def test_latency_histogram_buckets_sum_and_max() -> None:
    h = LatencyHistogram(buckets=(0.001, 0.01))
    for value in (0.0005, 0.002, 0.002, 5.0):
        h.observe(value)
    assert h.to_dict() == {"counts": [1, 2, 1], "sum": 5.0045, "count": 4, "max": 5.0}
