"""When a local cluster restarts a stage process that exited, and when it gives up.

A stage that exits is restarted after a delay: ``first_delay_s``, doubling with each start in a
row that failed, up to ``max_delay_s``. A start failed when the stage exited before it had
served ``healthy_after_s`` (a stage that never listened served 0 s); a stage that ran longer
starts the count afresh. After ``max_failed_starts`` failed starts in a row the stage stays
down: a crash loop (a bad GPU, a full disk) is not worth a restart every few seconds forever.

Durations go in as values, so the caller's clock is the only clock (tests pass plain numbers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartDecision:
    failed_starts: int
    """failed starts in a row, counting the exit just seen; the next decision's input"""
    delay_s: float | None
    """wait this long, then restart; None: give up, the stage stays down"""


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    healthy_after_s: float = 60.0
    max_failed_starts: int = 10

    def __post_init__(self) -> None:
        if not 0 <= self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 <= first_delay_s <= max_delay_s")
        if self.healthy_after_s < 0 or self.max_failed_starts < 1:
            raise ValueError("need healthy_after_s >= 0 and max_failed_starts >= 1")

    def after_exit(self, failed_starts: int, served_s: float) -> RestartDecision:
        """What to do about a stage that exited after serving ``served_s`` seconds, given the
        ``failed_starts`` in a row before this exit (0 at first)."""
        if served_s >= self.healthy_after_s:
            return RestartDecision(0, self.first_delay_s)
        failed = failed_starts + 1
        if failed >= self.max_failed_starts:
            return RestartDecision(failed, None)
        # The first failure waits first_delay_s too; each further one doubles it.
        delay = self.first_delay_s * 2.0 ** min(failed - 1, 64)
        return RestartDecision(failed, min(delay, self.max_delay_s))
