"""The GPipe model of a pipeline pass, as pure values: the yardstick, not the runtime.

With ``k`` stages and ``m`` micro-batches, stage ``s`` runs micro-batch ``b`` at tick ``s + b``;
the ``k - 1`` ticks each stage waits at the start (or finishes early) are the pipeline bubble,
``bubble_fraction``. The runtime does not run these programs: stages forward whatever arrives
and the coordinator's micro-batcher keeps decoding sequences cycling. What is used is
``suggested_micro_batch_size`` (the ``--pp-micro-batch-size auto`` default of ``mlxppd serve``)
and ``bubble_fraction``, the theoretical figure ``bench/bubble.py`` sets next to the measured
bubble; the tick-by-tick schedule (``GPipeSchedule``) states the model its tests check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Forward:
    """Run this stage's layers on the micro-batch."""

    stage_index: int
    micro_batch_id: int


@dataclass(frozen=True)
class Receive:
    """Wait for the previous stage's activations of the micro-batch."""

    stage_index: int
    micro_batch_id: int


@dataclass(frozen=True)
class Flush:
    """The last stage emits the micro-batch's output (sampled tokens)."""

    micro_batch_id: int


@dataclass(frozen=True)
class Idle:
    """Nothing to do at this tick (a bubble slot)."""


@dataclass(frozen=True)
class Done:
    """Every micro-batch has passed this stage."""


Action = Forward | Receive | Flush | Idle | Done


def bubble_fraction(num_stages: int, num_micro_batches: int) -> Fraction:
    """(k - 1) / (m + k - 1): the share of stage-ticks spent idle in one GPipe pass."""
    _check(num_stages, num_micro_batches)
    return Fraction(num_stages - 1, num_micro_batches + num_stages - 1)


def suggested_micro_batch_size(batch_size: int, num_stages: int) -> int:
    """Sequences per micro-batch so there are about as many micro-batches as stages."""
    if batch_size < 1 or num_stages < 1:
        raise ValueError("batch_size and num_stages must be at least 1")
    return math.ceil(batch_size / num_stages)


def split_micro_batches(items: list[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive micro-batches of at most ``micro_batch_size`` items each."""
    if micro_batch_size < 1:
        raise ValueError("micro_batch_size must be at least 1")
    return [items[i : i + micro_batch_size] for i in range(0, len(items), micro_batch_size)]


def _check(num_stages: int, num_micro_batches: int) -> None:
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError("a schedule needs at least one stage and one micro-batch")


@dataclass(frozen=True)
class GPipeSchedule:
    num_stages: int
    num_micro_batches: int

    def __post_init__(self) -> None:
        _check(self.num_stages, self.num_micro_batches)

    @property
    def num_ticks(self) -> int:
        return self.num_micro_batches + self.num_stages - 1

    def program(self, stage_index: int) -> tuple[Action, ...]:
        """The ordered actions one stage carries out, ending with Done."""
        last = stage_index == self.num_stages - 1
        actions: list[Action] = []
        for mb in range(self.num_micro_batches):
            if stage_index > 0:
                actions.append(Receive(stage_index, mb))
            actions.append(Forward(stage_index, mb))
            if last:
                actions.append(Flush(mb))
        actions.append(Done())
        return tuple(actions)

    def tick(self, t: int) -> tuple[Action, ...]:
        """What every stage does at tick ``t``: its Forward, or Idle in a bubble slot."""
        row: list[Action] = []
        for s in range(self.num_stages):
            mb = t - s
            row.append(Forward(s, mb) if 0 <= mb < self.num_micro_batches else Idle())
        return tuple(row)

    def timeline(self) -> tuple[tuple[Action, ...], ...]:
        return tuple(self.tick(t) for t in range(self.num_ticks))
