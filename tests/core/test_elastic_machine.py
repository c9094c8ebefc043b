"""The elastic repartition state machine: every transition, rejection and event."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxppd.core.agent.elastic import (
    ElasticMachine,
    ElasticState,
    Outcome,
    Rejection,
    Trigger,
    begin,
    drained,
    fail,
    planned,
    pressured_stage,
    resumed,
)
from mlxppd.core.config.cluster import ElasticPolicy
from mlxppd.core.layer_ranges import LayerRange

OLD = (LayerRange(0, 15), LayerRange(15, 30))
NEW = (LayerRange(0, 10), LayerRange(10, 30))
POLICY = ElasticPolicy(enabled=True, cool_down_s=30.0)


def idle(**kw: object) -> ElasticMachine:
    return ElasticMachine(POLICY, OLD, **kw)  # type: ignore[arg-type]


def started(trigger: Trigger = Trigger.EXPLICIT, now: float = 100.0) -> ElasticMachine:
    step = begin(idle(), trigger, now)
    assert not isinstance(step, Rejection)
    return step[0]


def test_a_full_repartition_walks_every_state_and_emits_an_event_each_time() -> None:
    m = idle()
    step = begin(m, Trigger.EXPLICIT, 100.0)
    assert not isinstance(step, Rejection)
    m, e1 = step
    m, e2 = drained(m, 103.0)
    m, e3 = planned(m, NEW, 103.5)
    m, e4 = resumed(m, 106.0)
    assert [(e.from_state, e.to_state, e.outcome) for e in (e1, e2, e3, e4)] == [
        (ElasticState.IDLE, ElasticState.DRAINING, Outcome.PROGRESS),
        (ElasticState.DRAINING, ElasticState.REBALANCING, Outcome.PROGRESS),
        (ElasticState.REBALANCING, ElasticState.RESUMING, Outcome.PROGRESS),
        (ElasticState.RESUMING, ElasticState.IDLE, Outcome.COMPLETED),
    ]
    # Durations: the time spent in the state left, and since the trigger.
    assert (e2.phase_s, e3.phase_s, e4.phase_s) == (3.0, 0.5, 2.5)
    assert e4.total_s == 6.0
    assert all(e.trigger is Trigger.EXPLICIT for e in (e1, e2, e3, e4))
    assert e1.ranges_after is None and e3.ranges_after == NEW and e4.ranges_before == OLD
    assert m.state is ElasticState.IDLE and m.ranges == NEW and m.finished_at == 106.0


ACTIVE = [ElasticState.DRAINING, ElasticState.REBALANCING, ElasticState.RESUMING]


@pytest.mark.parametrize("state", ACTIVE)
@pytest.mark.parametrize("trigger", list(Trigger))
def test_a_running_repartition_rejects_another(state: ElasticState, trigger: Trigger) -> None:
    assert begin(idle(state=state, trigger=Trigger.EXPLICIT), trigger, 1.0) is Rejection.BUSY


def test_memory_pressure_respects_the_cool_down_and_explicit_bypasses_it() -> None:
    m = idle(finished_at=100.0)
    assert begin(m, Trigger.MEMORY_PRESSURE, 129.9) is Rejection.COOL_DOWN
    assert not isinstance(begin(m, Trigger.EXPLICIT, 100.1), Rejection)
    assert not isinstance(begin(m, Trigger.MEMORY_PRESSURE, 130.0), Rejection)


def test_memory_pressure_fires_once_per_cool_down() -> None:
    """Pressure that never lets up, checked every second (as the driver does), starts one
    repartition per cool-down; each takes 5 s and the cool-down runs from its end."""
    m = idle()
    fired: list[float] = []
    for tick in range(200):
        now = float(tick)
        if m.state is ElasticState.DRAINING and now >= fired[-1] + 5.0:
            m, _ = drained(m, now)
            m, _ = planned(m, NEW, now)
            m, _ = resumed(m, now)
        step = begin(m, Trigger.MEMORY_PRESSURE, now)
        if isinstance(step, Rejection):
            busy = m.state is ElasticState.DRAINING
            assert step is (Rejection.BUSY if busy else Rejection.COOL_DOWN), (now, step)
            continue
        m, event = step
        assert event.trigger is Trigger.MEMORY_PRESSURE
        fired.append(now)
    assert fired == [0.0, 35.0, 70.0, 105.0, 140.0, 175.0]


def test_the_cool_down_in_force_is_the_policys_now() -> None:
    # The driver swaps in a reloaded policy; the cool-down already running is measured by it.
    m = idle(finished_at=100.0)
    longer = replace(m, policy=ElasticPolicy(enabled=True, cool_down_s=3600.0))
    assert begin(longer, Trigger.MEMORY_PRESSURE, 3699.0) is Rejection.COOL_DOWN
    none = replace(m, policy=ElasticPolicy(enabled=True, cool_down_s=0.0))
    assert not isinstance(begin(none, Trigger.MEMORY_PRESSURE, 100.0), Rejection)


def test_the_first_memory_pressure_needs_no_cool_down() -> None:
    assert not isinstance(begin(idle(), Trigger.MEMORY_PRESSURE, 0.0), Rejection)


def test_only_an_explicit_trigger_leaves_failed() -> None:
    m, _ = fail(started(), "boom", 110.0)
    assert begin(m, Trigger.MEMORY_PRESSURE, 1000.0) is Rejection.FAILED_NEEDS_EXPLICIT
    step = begin(m, Trigger.EXPLICIT, 110.5)
    assert not isinstance(step, Rejection)
    assert step[1].from_state is ElasticState.FAILED and step[1].to_state is ElasticState.DRAINING


def test_disabled_policy_rejects_everything() -> None:
    m = ElasticMachine(ElasticPolicy(enabled=False), OLD)
    assert begin(m, Trigger.EXPLICIT, 0.0) is Rejection.DISABLED
    assert "enabled = true" in Rejection.DISABLED.sentence()


@pytest.mark.parametrize("advance", ["draining", "rebalancing", "resuming"])
def test_failure_at_any_step_keeps_the_old_ranges(advance: str) -> None:
    m = started()
    if advance in ("rebalancing", "resuming"):
        m, _ = drained(m, 101.0)
    if advance == "resuming":
        m, _ = planned(m, NEW, 102.0)
    m, event = fail(m, "a stage could not load its layers", 104.0)
    assert m.state is ElasticState.FAILED and m.ranges == OLD and m.target is None
    assert event.outcome is Outcome.FAILED and event.to_state is ElasticState.FAILED
    assert event.detail == "a stage could not load its layers"
    assert m.finished_at == 104.0


def test_a_drain_timeout_is_aborted() -> None:
    m, event = fail(started(), "in flight after 5 s", 105.0, aborted=True)
    assert event.outcome is Outcome.ABORTED and m.state is ElasticState.FAILED
    assert event.phase_s == 5.0


def test_transitions_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="not rebalancing"):
        planned(started(), NEW, 1.0)
    with pytest.raises(ValueError, match="not draining"):
        drained(idle(), 1.0)
    with pytest.raises(ValueError, match="nothing to fail"):
        fail(idle(), "x", 1.0)


def test_event_description_and_dict() -> None:
    m = started()
    m, _ = drained(m, 101.0)
    _, event = planned(m, NEW, 101.25)
    assert event.describe() == (
        "rebalancing -> resuming (progress, explicit) after 0.25 s; layers 0-14,15-29 -> 0-9,10-29"
    )
    assert event.to_dict()["ranges_after"] == "0-9,10-29"


def test_pressured_stage() -> None:
    assert pressured_stage([(0, 10, 100), (1, 92, 100)], 0.92) == 1
    assert pressured_stage([(0, 91, 100), (1, 10**9, None)], 0.92) is None
