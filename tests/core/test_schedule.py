"""The GPipe schedule as pure values: programs, timeline, bubbles, micro-batch sizing."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxppd.core.schedule import (
    Done,
    Flush,
    Forward,
    GPipeSchedule,
    Idle,
    Receive,
    bubble_fraction,
    split_micro_batches,
    suggested_micro_batch_size,
)


def test_three_stages_four_micro_batches_match_the_spec_chart() -> None:
    schedule = GPipeSchedule(num_stages=3, num_micro_batches=4)
    timeline = schedule.timeline()
    assert len(timeline) == 6
    assert timeline[0] == (Forward(0, 0), Idle(), Idle())
    assert timeline[2] == (Forward(0, 2), Forward(1, 1), Forward(2, 0))
    assert timeline[5] == (Idle(), Idle(), Forward(2, 3))


def test_programs_receive_before_forward_and_the_last_stage_flushes() -> None:
    schedule = GPipeSchedule(num_stages=2, num_micro_batches=2)
    assert schedule.program(0) == (Forward(0, 0), Forward(0, 1), Done())
    assert schedule.program(1) == (
        Receive(1, 0),
        Forward(1, 0),
        Flush(0),
        Receive(1, 1),
        Forward(1, 1),
        Flush(1),
        Done(),
    )


def test_bubble_fraction_examples_from_the_spec() -> None:
    assert bubble_fraction(4, 16) == Fraction(3, 19)
    assert float(bubble_fraction(4, 16)) == pytest.approx(3 / 19)
    assert float(bubble_fraction(4, 32)) == pytest.approx(3 / 35)
    assert bubble_fraction(1, 5) == 0


@given(st.integers(1, 8), st.integers(1, 40))
def test_idle_slots_in_the_timeline_equal_the_bubble_formula(k: int, m: int) -> None:
    timeline = GPipeSchedule(k, m).timeline()
    slots = [a for row in timeline for a in row]
    idle = sum(isinstance(a, Idle) for a in slots)
    assert Fraction(idle, len(slots)) == bubble_fraction(k, m)
    # every (stage, micro-batch) runs exactly once, micro-batches in order per stage
    forwards = [a for a in slots if isinstance(a, Forward)]
    assert sorted((f.stage_index, f.micro_batch_id) for f in forwards) == [
        (s, b) for s in range(k) for b in range(m)
    ]


@given(st.integers(1, 200), st.integers(1, 16))
def test_suggested_micro_batch_size_fills_every_stage(batch: int, stages: int) -> None:
    size = suggested_micro_batch_size(batch, stages)
    micro_batches = split_micro_batches(list(range(batch)), size)
    assert len(micro_batches) <= stages
    assert sum(len(mb) for mb in micro_batches) == batch
    assert size == -(-batch // stages)


def test_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        GPipeSchedule(0, 3)
    with pytest.raises(ValueError):
        suggested_micro_batch_size(0, 2)
