"""A recovery's passes: which stages it builds on after each loss, and when it restarts, with
the caller's clock injected (``core/recovery_passes.py``)."""

from __future__ import annotations

import pytest

from mlxppd.core.recovery_passes import RecoveryPass, describe_stages

NODES = ("stage-0", "stage-1", "stage-2")


def first_loss(stage: int = 1, now: float = 100.0, grace_s: float = 10.0) -> RecoveryPass:
    return RecoveryPass.first(NODES, [stage], now, grace_s)


def test_the_first_pass_builds_on_every_stage_but_the_lost_one_after_its_grace() -> None:
    p = first_loss()
    assert (p.number, p.survivors, p.describe_lost()) == (1, (0, 2), "stage 1 (stage-1)")
    assert (p.grace_ends, p.grace_over(109.9), p.grace_over(110.0)) == (110.0, False, True)


def test_a_stage_lost_during_the_recovery_restarts_it_on_the_survivors_left() -> None:
    second = first_loss().lose([2], now=130.0)
    assert second is not None
    assert (second.number, second.lost, second.survivors) == (2, frozenset({1, 2}), (0,))
    # The new pass has a grace of its own, from its own start: the second node may come back.
    assert (second.started, second.grace_over(139.0), second.grace_over(140.0)) == (
        130.0, False, True,
    )  # fmt: skip
    assert second.describe_lost() == "stages 1 (stage-1) and 2 (stage-2)"


def test_a_lost_node_that_came_back_and_went_away_again_restarts_the_pass() -> None:
    again = first_loss().lose([1], now=120.0)
    assert again is not None
    assert (again.number, again.lost, again.started) == (2, frozenset({1}), 120.0)


def test_with_no_stage_left_there_is_no_next_pass() -> None:
    second = first_loss().lose([2], now=130.0)
    assert second is not None
    assert second.lose([0], now=140.0) is None


def test_a_restart_names_what_was_lost() -> None:
    with pytest.raises(ValueError, match="needs the stages that were lost"):
        first_loss().lose([], now=1.0)
    with pytest.raises(ValueError, match="not all in"):
        first_loss().lose([3], now=1.0)


def test_standbys_take_the_lost_places_only_when_there_is_one_for_each() -> None:
    p = first_loss().lose([2], now=130.0)
    assert p is not None
    assert (p.adopted(0), p.adopted(1), p.adopted(2), p.adopted(3)) == (None, None, (1, 2), (1, 2))
    assert first_loss(0).adopted(1) == (0,)


def test_the_survivors_share_the_layers_with_a_standby_in_each_lost_place_there_is_one_for() -> (
    None
):
    p = first_loss().lose([2], now=130.0)
    assert p is not None
    assert p.shared(0) == (0,)
    assert p.shared(1) == (0, None)  # the standby stands where stage 1 stood
    assert p.shared(2) == (0, None, None)
    assert first_loss(0).shared(0) == (1, 2)


def test_a_restore_loses_nothing_to_begin_with() -> None:
    p = RecoveryPass.first(NODES, [], 0.0, 10.0)
    assert (p.survivors, p.adopted(5), p.shared(5), p.describe_lost()) == (
        (0, 1, 2), None, (0, 1, 2), "no stage",
    )  # fmt: skip


def test_stages_are_named_in_one_phrase() -> None:
    assert describe_stages(NODES, [0, 1, 2]) == "stages 0 (stage-0), 1 (stage-1) and 2 (stage-2)"
