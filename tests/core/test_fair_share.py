"""The sequences in flight, shared fairly between clients when the pipeline is full."""

from __future__ import annotations

import pytest

from mlxppd.core.fair_share import Ask, Shares, Verdict, ask, cancel, per_client, release


def asked(shares: Shares, *asks: tuple[int, str, int]) -> tuple[Shares, list[Verdict]]:
    verdicts = []
    for ticket, client, count in asks:
        shares, verdict = ask(shares, Ask(ticket, client, count))
        verdicts.append(verdict)
    return shares, verdicts


def test_requests_are_admitted_while_their_sequences_fit() -> None:
    shares, verdicts = asked(Shares(8, 8), (0, "a", 4), (1, "b", 3), (2, "a", 1))
    assert verdicts == [Verdict.ADMITTED] * 3
    assert shares.in_use == 8
    assert shares.holding("a") == 5 and shares.holding("b") == 3


def test_sequences_not_requests_are_counted() -> None:
    # Two requests of 4 choices fill a capacity of 8: a third request of one choice does not fit.
    shares, verdicts = asked(Shares(8, 8), (0, "a", 4), (1, "b", 4), (2, "c", 1))
    assert verdicts == [Verdict.ADMITTED, Verdict.ADMITTED, Verdict.WAITING]


def test_no_client_takes_the_reserve_kept_for_the_next_one() -> None:
    assert [per_client(c) for c in (1, 2, 8, 9, 64)] == [1, 1, 7, 8, 56]
    shares, verdicts = asked(Shares(64, 64), *((i, "a", 16) for i in range(4)))
    assert verdicts == [Verdict.ADMITTED] * 3 + [Verdict.OVER_SHARE]
    # the next client finds room at once
    _, verdicts = asked(shares, (4, "b", 1))
    assert verdicts == [Verdict.ADMITTED]


def test_a_client_over_its_share_of_a_full_pipeline_is_refused() -> None:
    shares, verdicts = asked(Shares(9, 9), (0, "a", 4), (1, "a", 4), (2, "b", 1), (3, "c", 1))
    assert verdicts == [Verdict.ADMITTED] * 3 + [Verdict.WAITING]
    # a holds 8 of 9 with b and c about: its share is 3
    shares, verdicts = asked(shares, (4, "a", 1))
    assert verdicts == [Verdict.OVER_SHARE]
    assert [r.ticket for r in shares.waiting] == [3]  # a refused request does not wait


def test_a_client_within_its_share_waits_and_is_served_before_the_one_holding_more() -> None:
    shares, verdicts = asked(Shares(8, 8), (0, "a", 4), (1, "c", 4), (2, "b", 1))
    assert verdicts[2] is Verdict.WAITING
    # a holds 4 of 8; with b and c about its share is 2: a fifth sequence of a's is refused.
    shares, more = asked(shares, (3, "a", 1))
    assert more == [Verdict.OVER_SHARE]
    shares, admitted = release(shares, "a", 4)
    assert [r.ticket for r in admitted] == [2]
    assert shares.holding("b") == 1 and shares.in_use == 5


def test_freed_room_goes_to_the_waiting_client_holding_the_fewest() -> None:
    shares, _ = asked(Shares(8, 8), (0, "a", 6), (1, "b", 2))
    shares, verdicts = asked(shares, (2, "b", 1), (3, "c", 1))
    assert verdicts == [Verdict.WAITING, Verdict.WAITING]
    shares, admitted = release(shares, "a", 1)
    # c holds nothing, b holds 2: c is served first though it came later.
    assert [r.ticket for r in admitted] == [3]
    shares, admitted = release(shares, "a", 1)
    assert [r.ticket for r in admitted] == [2]
    assert shares.waiting == ()


def test_a_newcomer_does_not_overtake_a_waiting_request_served_before_it() -> None:
    shares, _ = asked(Shares(4, 8), (0, "a", 3))
    shares, verdicts = asked(shares, (1, "c", 2), (2, "d", 1))
    # d's one sequence would fit, but c came first and holds as few: a large request is not
    # overtaken for ever by small ones.
    assert verdicts == [Verdict.WAITING, Verdict.WAITING]
    shares, admitted = release(shares, "a", 1)
    assert [r.ticket for r in admitted] == [1]
    assert [r.ticket for r in shares.waiting] == [2]


def test_the_queue_is_bounded() -> None:
    shares, verdicts = asked(Shares(3, 1), (0, "a", 2), (1, "d", 1), (2, "b", 1), (3, "c", 1))
    assert verdicts == [Verdict.ADMITTED, Verdict.ADMITTED, Verdict.WAITING, Verdict.QUEUE_FULL]


def test_no_queue_refuses_at_once_when_full() -> None:
    _, verdicts = asked(Shares(1, 0), (0, "a", 1), (1, "b", 1))
    assert verdicts == [Verdict.ADMITTED, Verdict.QUEUE_FULL]


def test_more_sequences_than_one_client_may_hold_can_never_run() -> None:
    _, verdicts = asked(Shares(8, 8), (0, "a", 8))
    assert verdicts == [Verdict.TOO_MANY]


def test_a_cancelled_wait_lets_the_requests_behind_it_in() -> None:
    shares, _ = asked(Shares(4, 8), (0, "a", 3))
    shares, verdicts = asked(shares, (1, "b", 2), (2, "c", 1))
    assert verdicts == [Verdict.WAITING, Verdict.WAITING]
    # b, first in line, cannot fit in the one free sequence; when it gives up, c fits.
    shares, admitted = cancel(shares, 1)
    assert [r.ticket for r in admitted] == [2]
    assert shares.waiting == () and shares.in_use == 4


def test_releasing_more_than_held_is_a_bug_not_a_negative_count() -> None:
    shares, _ = asked(Shares(4, 4), (0, "a", 1))
    with pytest.raises(ValueError, match="releases more"):
        release(shares, "a", 2)


@pytest.mark.parametrize(("capacity", "waiting"), [(0, 1), (1, -1)])
def test_bounds_are_checked(capacity: int, waiting: int) -> None:
    with pytest.raises(ValueError):
        Shares(capacity, waiting)


def test_the_share_is_the_capacity_divided_among_active_clients() -> None:
    shares, _ = asked(Shares(9, 9), (0, "a", 5), (1, "b", 4))
    assert shares.share("a") == 4  # a and b
    assert shares.share("c") == 3  # a, b and c
