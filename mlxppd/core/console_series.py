"""The web console's live charts (pure): rates between two readings of the coordinator's
cumulative counters.

The console samples its metrics every few seconds (``http/console_feed.py``); each pair of
consecutive readings becomes one chart point: tokens and requests per second over the
interval, the mean time to first token of the requests whose first token came in it, and each
stage's busy fraction as its last report said.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reading:
    """The counters at one moment (cumulative since the coordinator started)."""

    at: float
    """wall clock, seconds since the epoch"""
    tokens: float
    """tokens generated"""
    requests: float
    """HTTP requests answered under /v1"""
    ttft_sum: float
    """seconds to first token, summed over the requests that got one"""
    ttft_count: float
    """requests that got a first token"""
    busy: tuple[tuple[int, float], ...] = ()
    """(stage, share of the last window it computed)"""


@dataclass(frozen=True)
class Point:
    """One chart point: what happened between two readings."""

    at: float
    """wall clock at the end of the interval, seconds since the epoch"""
    tokens_s: float
    """tokens generated per second"""
    requests_s: float
    """requests answered per second"""
    ttft_s: float | None
    """mean time to first token of the requests whose first token came in the interval
    (None: none did)"""
    busy: tuple[tuple[int, float], ...]
    """(stage, busy fraction 0-1)"""

    def to_json(self) -> dict[str, object]:
        return {
            "at": round(self.at, 3),
            "tokens_s": round(self.tokens_s, 3),
            "requests_s": round(self.requests_s, 3),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "busy": {str(stage): round(share, 4) for stage, share in self.busy},
        }


def point_between(before: Reading, after: Reading) -> Point | None:
    """The point for the interval from ``before`` to ``after``; None when no time passed.
    A counter that went down (a restarted coordinator) counts from zero."""
    seconds = after.at - before.at
    if seconds <= 0:
        return None

    def grown(new: float, old: float) -> float:
        return new - old if new >= old else new

    firsts = grown(after.ttft_count, before.ttft_count)
    waited = grown(after.ttft_sum, before.ttft_sum)
    return Point(
        at=after.at,
        tokens_s=grown(after.tokens, before.tokens) / seconds,
        requests_s=grown(after.requests, before.requests) / seconds,
        ttft_s=waited / firsts if firsts > 0 else None,
        busy=after.busy,
    )
