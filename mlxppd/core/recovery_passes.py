"""Which stages a failover builds on, pass after pass (``runtime/coordinator/recovery.py``).

A recovery starts from the pipeline that served when a stage was lost. Each pass first tries
every one of its nodes again for the reconnect grace; then it builds on the survivors: idle
standbys in the lost places, or the survivors (with what standbys there are) sharing every
layer. A stage lost while a pass runs (it does not answer when the pass reaches it, or its
link fails while layers load) does not end the recovery: the next pass starts from the
survivors left, with a grace of its own, until no stage survives. Pure: the caller's clock
comes in as ``now``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

__all__ = ["RecoveryPass", "describe_stages"]


@dataclass(frozen=True)
class RecoveryPass:
    """One pass of a recovery: the pipeline it started from, what is lost, its grace."""

    nodes: tuple[str, ...]
    """the node of each stage of the pipeline the recovery started from, in stage order"""
    lost: frozenset[int]
    """the stage indices lost so far (empty: none; a restore of the file's layout)"""
    started: float
    """when this pass began, seconds on the caller's clock"""
    grace_s: float
    """how long this pass tries every node of the pipeline again before building without"""
    number: int = 1
    """1 for the first pass, one more after each restart"""

    def __post_init__(self) -> None:
        if any(not 0 <= i < len(self.nodes) for i in self.lost):
            raise ValueError(f"lost stages {sorted(self.lost)} are not all in {self.nodes}")

    @classmethod
    def first(
        cls, nodes: Sequence[str], lost: Iterable[int], now: float, grace_s: float
    ) -> RecoveryPass:
        return cls(tuple(nodes), frozenset(lost), now, grace_s)

    @property
    def survivors(self) -> tuple[int, ...]:
        """The stage indices not lost, in stage order."""
        return tuple(i for i in range(len(self.nodes)) if i not in self.lost)

    @property
    def grace_ends(self) -> float:
        """When the pass stops waiting for every node and builds on the survivors."""
        return self.started + self.grace_s

    def grace_over(self, now: float) -> bool:
        return now >= self.grace_ends

    def lose(self, stages: Iterable[int], now: float) -> RecoveryPass | None:
        """The pass after ``stages`` were lost (too, or again: a lost node that came back in
        the grace and went away once more), starting at ``now`` with a grace of its own; None
        when no stage would survive (nothing is left to build on)."""
        more = frozenset(stages)
        if not more:
            raise ValueError("a restart needs the stages that were lost")
        lost = self.lost | more
        if len(lost) >= len(self.nodes):
            return None
        return replace(self, lost=lost, started=now, number=self.number + 1)

    def adopted(self, standbys: int) -> tuple[int, ...] | None:
        """The lost stages that ``standbys`` idle standbys take, one each in stage order;
        None when there are too few for all of them (the survivors then share the layers)."""
        if not self.lost or standbys < len(self.lost):
            return None
        return tuple(sorted(self.lost))

    def shared(self, standbys: int) -> tuple[int | None, ...]:
        """The pipeline when the survivors share every layer, with up to one idle standby in
        each lost place (the first ones): each stage's original index, None for a standby."""
        taken = set(sorted(self.lost)[: max(0, standbys)])
        stages: list[int | None] = []
        for i in range(len(self.nodes)):
            if i not in self.lost:
                stages.append(i)
            elif i in taken:
                stages.append(None)
        return tuple(stages)

    def describe_lost(self) -> str:
        """The lost stages, for a log line: ``stage 1 (stage-1)``, ``stages 1 (a) and 2 (b)``."""
        return describe_stages(self.nodes, sorted(self.lost))


def describe_stages(nodes: Sequence[str], stages: Sequence[int]) -> str:
    """``stage 1 (stage-1)``, or ``stages 1 (stage-1) and 2 (stage-2)``."""
    named = [f"{i} ({nodes[i]})" for i in stages]
    if not named:
        return "no stage"
    if len(named) == 1:
        return f"stage {named[0]}"
    return "stages " + ", ".join(named[:-1]) + " and " + named[-1]
