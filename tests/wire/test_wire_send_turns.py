"""Send turns: one record writer at a time, first come first served, never lost on cancel."""

from __future__ import annotations

import asyncio

from mlxppd.wire.channel import SendTurns
from tests.support.wire import run


def test_a_free_turn_is_taken_at_once_and_a_held_one_is_not() -> None:
    turns = SendTurns()
    assert turns.try_take()
    assert not turns.try_take()
    turns.give_back()
    assert turns.try_take()


def test_waiters_get_the_turn_in_the_order_they_asked() -> None:
    async def scenario() -> None:
        turns = SendTurns()
        assert turns.try_take()
        order: list[int] = []

        async def writer(i: int) -> None:
            await turns.take()
            order.append(i)
            await asyncio.sleep(0)  # hold the turn across a yield, as a waiting write does
            turns.give_back()

        tasks = [asyncio.create_task(writer(i)) for i in range(5)]
        await asyncio.sleep(0)
        assert not turns.try_take()  # waiters queue: a newcomer cannot jump ahead
        turns.give_back()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4]
        assert turns.try_take()  # the last one gave it back to nobody

    run(scenario)


def test_a_cancelled_waiter_is_skipped() -> None:
    async def scenario() -> None:
        turns = SendTurns()
        assert turns.try_take()
        cancelled = asyncio.create_task(turns.take())
        patient = asyncio.create_task(turns.take())
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        turns.give_back()
        await asyncio.wait_for(patient, 1)
        assert cancelled.cancelled()
        assert not turns.try_take()  # the patient waiter holds it now
        turns.give_back()
        assert turns.try_take()

    run(scenario)


def test_a_turn_handed_to_a_waiter_cancelled_at_that_moment_passes_on() -> None:
    async def scenario() -> None:
        turns = SendTurns()
        assert turns.try_take()
        first = asyncio.create_task(turns.take())
        second = asyncio.create_task(turns.take())
        await asyncio.sleep(0)
        turns.give_back()  # hands the turn to ``first`` ...
        first.cancel()  # ... which is cancelled before it runs
        await asyncio.wait_for(second, 1)
        assert first.cancelled()
        turns.give_back()
        assert turns.try_take()  # nothing leaked: the turn is free again

    run(scenario)
