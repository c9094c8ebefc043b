"""The coordinator's serving state: one enum and its transitions, with an injected clock."""

from __future__ import annotations

import pytest

from mlxppd.core.serving_state import (
    TRANSITIONS,
    InvalidTransition,
    Serving,
    ServingEvent,
    ServingState,
)

S, E = ServingState, ServingEvent


def walk(*steps: tuple[ServingEvent, str]) -> list[Serving]:
    """The states after each step, the clock at 10, 20, 30, ... seconds."""
    state, seen = Serving(since=0.0), []
    for i, (event, detail) in enumerate(steps, start=1):
        state = state.on(event, detail, now=10.0 * i)
        seen.append(state)
    return seen


def test_a_failover_pauses_requests_then_serves_again() -> None:
    started, lost, back = walk(
        (E.START, "all stages connected"),
        (E.LOSE_RECOVERABLE, "lost stage 1 (stage-1): closed"),
        (E.RECOVER, "all stages connected"),
    )
    assert (started.state, started.since) == (S.SERVING, 10.0)
    assert (lost.state, lost.since, lost.waits, lost.refuses) == (S.RECOVERING, 20.0, True, False)
    assert lost.health_detail() == "recovering: lost stage 1 (stage-1): closed"
    assert (back.state, back.since, back.waits) == (S.SERVING, 30.0, False)
    assert back.health_detail() == "all stages connected"


def test_a_failed_recovery_is_down_until_the_stage_comes_back() -> None:
    *_, down, back = walk(
        (E.START, ""), (E.LOSE_RECOVERABLE, "lost stage 0"), (E.GIVE_UP, "no standby"),
        (E.RECOVER, "all stages connected"),
    )  # fmt: skip
    assert (down.state, down.refuses, down.health_detail()) == (S.DOWN, True, "no standby")
    assert back.state is S.SERVING


def test_down_keeps_its_first_reason_and_its_time() -> None:
    *_, first, again = walk((E.START, ""), (E.LOSE, "stage 1 closed"), (E.LOSE, "stage 0 too"))
    assert first == again
    assert (again.detail, again.since) == ("stage 1 closed", 20.0)


def test_a_loss_while_starting_is_down_and_a_wrong_model_breaks_a_serving_pipeline() -> None:
    (down,) = walk((E.LOSE, "stage 0 did not answer"))
    assert down.state is S.DOWN
    _, broken = walk((E.START, ""), (E.BREAK, "stage 1 serves other weights"))
    assert (broken.state, broken.health_detail()) == (S.DOWN, "stage 1 serves other weights")


def test_stopping_during_a_failover_says_so_and_is_final() -> None:
    *_, stopped = walk((E.START, ""), (E.LOSE_RECOVERABLE, "lost"), (E.STOP, "stopped"))
    assert stopped.state is S.STOPPED and stopped.refuses
    assert stopped.detail == "the coordinator stopped during a failover"
    with pytest.raises(InvalidTransition, match="stopped cannot take recover"):
        stopped.on(E.RECOVER, "", 1.0)


@pytest.mark.parametrize(
    "state,event",
    [(s, e) for s in ServingState for e in ServingEvent if (s, e) not in TRANSITIONS],
)
def test_every_other_pair_is_refused(state: ServingState, event: ServingEvent) -> None:
    with pytest.raises(InvalidTransition):
        Serving(state=state).on(event, "", 0.0)


def test_a_recovery_is_only_entered_from_serving_or_a_restore() -> None:
    entering = {s for (s, e), t in TRANSITIONS.items() if t is S.RECOVERING}
    assert entering == {S.SERVING, S.RESTORING}


def test_a_restore_holds_new_requests_then_serves_the_files_layout() -> None:
    *_, restoring, back = walk(
        (E.START, ""), (E.RESTORE, "putting the cluster file's layout back"),
        (E.RECOVER, "all stages connected"),
    )  # fmt: skip
    assert (restoring.state, restoring.since, restoring.waits, restoring.refuses) == (
        S.RESTORING, 20.0, True, False,
    )  # fmt: skip
    assert restoring.health_detail() == "restoring: putting the cluster file's layout back"
    assert (back.state, back.waits) == (S.SERVING, False)


def test_a_stage_lost_during_a_restore_is_a_failover_and_a_failed_restore_is_down() -> None:
    *_, lost = walk((E.START, ""), (E.RESTORE, ""), (E.LOSE_RECOVERABLE, "lost stage 0"))
    assert (lost.state, lost.detail) == (S.RECOVERING, "lost stage 0")
    *_, down = walk((E.START, ""), (E.RESTORE, ""), (E.GIVE_UP, "no layout"))
    assert (down.state, down.refuses) == (S.DOWN, True)
    *_, stopped = walk((E.START, ""), (E.RESTORE, ""), (E.STOP, ""))
    assert stopped.detail == "the coordinator stopped while restoring the cluster file's layout"


def test_a_restore_starts_only_from_serving() -> None:
    entering = {s for (s, e), t in TRANSITIONS.items() if t is S.RESTORING}
    assert entering == {S.SERVING}
