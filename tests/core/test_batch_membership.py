"""The membership rules of a decode micro-batch: a sequence joins once prefilled, rides from
the next step boundary, and a sequence that leaves while a step carrying it is in flight is
freed only once that step is answered; a member a stage dropped fails alone."""

from __future__ import annotations

import pytest

from mlxppd.core.batch_membership import GroupMembership, Phase


def stepped(group: GroupMembership, *ready: str) -> tuple[GroupMembership, tuple[str, ...]]:
    return group.next_step(set(ready))


def test_joiners_ride_from_the_next_step_once_their_input_is_ready() -> None:
    group = GroupMembership("g").join("a").join("b")
    assert group.phase("a") is Phase.JOINING
    group, rows = stepped(group, "a")
    assert rows == ("a",) and group.phase("a") is Phase.MEMBER
    assert group.phase("b") is Phase.JOINING  # its prefill's token had not come yet


def test_no_step_goes_while_one_is_in_flight_or_a_member_lacks_its_input() -> None:
    group, _ = stepped(GroupMembership("g").join("a").join("b"), "a", "b")
    assert stepped(group, "a", "b")[1] == ()  # in flight
    group = group.answered(["a", "b"]).group
    assert stepped(group, "a")[1] == ()  # b's token is still on its way to its client
    assert stepped(group, "a", "b")[1] == ("a", "b")


def test_a_sequence_leaving_between_steps_is_freed_at_once() -> None:
    group, _ = stepped(GroupMembership("g").join("a").join("b"), "a", "b")
    group = group.answered(["a", "b"]).group
    group, now = group.leave("b")
    assert now and group.phase("b") is None
    assert stepped(group, "a")[1] == ("a",)


def test_a_sequence_leaving_during_its_step_is_freed_only_when_the_step_is_answered() -> None:
    group, _ = stepped(GroupMembership("g").join("a").join("b"), "a", "b")
    group, now = group.leave("b")
    assert not now and group.phase("b") is Phase.LEAVING
    assert group.leave("b") == (group, False)  # leaving twice changes nothing
    answer = group.answered(["a", "b"])
    assert answer.released == ("b",) and answer.dropped == ()
    assert answer.group.phase("b") is None
    assert stepped(answer.group, "a")[1] == ("a",)


def test_a_member_missing_from_the_answer_fails_alone_and_the_group_goes_on() -> None:
    group, _ = stepped(GroupMembership("g").join("a").join("b").join("c"), "a", "b", "c")
    answer = group.answered(["a", "c"])
    assert answer.dropped == ("b",) and answer.released == ()
    assert answer.group.members == ("a", "c")
    assert stepped(answer.group, "a", "c")[1] == ("a", "c")


def test_an_answer_with_no_step_in_flight_is_stale_and_changes_nothing() -> None:
    group = GroupMembership("g").join("a")
    assert group.answered(["a"]).group == group


def test_a_group_is_idle_only_with_no_member_joiner_or_step_in_flight() -> None:
    group, _ = stepped(GroupMembership("g").join("a"), "a")
    group, _ = group.leave("a")
    assert not group.idle  # its step is still on its way
    assert group.answered(["a"]).group.idle


def test_a_sequence_cannot_join_twice() -> None:
    with pytest.raises(ValueError, match="already joining"):
        GroupMembership("g").join("a").join("a")


def test_a_row_failed_by_a_stage_ends_its_part_of_the_step() -> None:
    group, _ = stepped(GroupMembership("g").join("a").join("b"), "a", "b")
    answer = group.row_failed("b")
    assert answer.group.in_flight == ("a",) and answer.group.members == ("a",)
    assert answer.group.answered(["a"]).group.members == ("a",)


def test_a_step_whose_every_row_failed_is_over_and_frees_who_left_during_it() -> None:
    """A stage that dropped every row sends no tokens: the failures end the step, or the
    group would wait for its answer forever, and every later joiner with it."""
    group, _ = stepped(GroupMembership("g").join("a").join("b"), "a", "b")
    group, _ = group.leave("a")
    first = group.row_failed("b")
    assert first.released == ("b",) and first.group.busy  # a's row may still be answered
    answer = first.group.row_failed("a")
    assert answer.released == ("a",)
    assert not answer.group.busy and answer.group.idle
    joined, rows = answer.group.join("c").next_step({"c"})
    assert rows == ("c",)


def test_a_leaving_sequence_whose_row_failed_is_freed_at_once() -> None:
    group, _ = stepped(GroupMembership("g").join("a").join("b"), "a", "b")
    group, _ = group.leave("b")
    answer = group.row_failed("b")
    assert answer.released == ("b",) and answer.group.in_flight == ("a",)
