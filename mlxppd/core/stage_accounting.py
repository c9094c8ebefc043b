"""A stage's time accounting and latency histograms, as pure values (times are passed in).

Busy time is time spent computing forward passes. Active time is time during which the stage
holds at least one sequence, i.e. the pipeline has work; active time not spent computing is the
stage's bubble (waiting for activations). A coordinator turns the cumulative seconds of two
reports into fractions over the interval between them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

#: activation hand-off latency buckets, seconds (loopback is ~1e-4, a LAN hop ~1e-3)
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


@dataclass
class ActivityClock:
    started: float
    busy_s: float = 0.0
    active_s: float = 0.0
    _active_since: float | None = None

    def busy(self, seconds: float) -> None:
        self.busy_s += max(0.0, seconds)

    def set_active(self, sequences: int, now: float) -> None:
        """Record how many sequences the stage holds from ``now`` on."""
        if sequences > 0 and self._active_since is None:
            self._active_since = now
        elif sequences == 0 and self._active_since is not None:
            self.active_s += now - self._active_since
            self._active_since = None

    def snapshot(self, now: float) -> dict[str, float]:
        active = self.active_s
        if self._active_since is not None:
            active += now - self._active_since
        return {"busy_s": self.busy_s, "active_s": active, "wall_s": now - self.started}


@dataclass
class LatencyHistogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    max: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds
        self.count += 1
        self.max = max(self.max, seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "counts": list(self.counts),
            "sum": self.total,
            "count": self.count,
            "max": self.max,
        }


def fractions(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """(busy fraction, bubble fraction) over the interval between two snapshots."""
    wall = after["wall_s"] - before["wall_s"]
    busy = after["busy_s"] - before["busy_s"]
    active = after["active_s"] - before["active_s"]
    busy_fraction = min(1.0, max(0.0, busy / wall)) if wall > 0 else 0.0
    bubble = min(1.0, max(0.0, 1.0 - busy / active)) if active > 0 else 0.0
    return busy_fraction, bubble
