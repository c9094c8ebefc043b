"""The sequence cap on the event loop: a waiting request is admitted when room frees, gives up
after its wait with a 503, and a refusal says why (``mlxppd/http/sequence_gate.py``)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from mlxppd.http.errors import ApiError
from mlxppd.http.sequence_gate import SequenceGate
from mlxppd.runtime.observability.metrics import PipelineMetrics


def test_a_waiting_request_goes_in_when_room_frees_and_the_gauges_follow() -> None:
    metrics = PipelineMetrics(CollectorRegistry())

    async def scenario() -> None:
        gate = SequenceGate(4, metrics=metrics)
        held = [await gate.admit("a", 3), await gate.admit("b", 1)]
        waiting = asyncio.ensure_future(gate.admit("c", 1))
        await asyncio.sleep(0)
        assert not waiting.done()
        assert metrics.sequences_waiting._value.get() == 1
        gate.release(held[0])
        assert (await asyncio.wait_for(waiting, 5)).count == 1
        assert metrics.sequences_in_flight._value.get() == 2
        assert metrics.sequences_waiting._value.get() == 0

    asyncio.run(scenario())


def test_a_wait_that_runs_out_is_a_503_and_frees_its_place() -> None:
    async def scenario() -> None:
        gate = SequenceGate(4, wait_s=0.01)
        await gate.admit("a", 3)
        await gate.admit("b", 1)
        with pytest.raises(ApiError) as refused:
            await gate.admit("c", 1)
        assert refused.value.status == 503 and refused.value.code == "queue_timeout"
        assert refused.value.headers["Retry-After"]
        assert gate.shares.waiting == ()

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    async def scenario() -> None:
        gate = SequenceGate(4)
        await gate.admit("a", 3)
        await gate.admit("b", 1)
        waiting = asyncio.ensure_future(gate.admit("c", 1))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert gate.shares.waiting == () and gate.shares.in_use == 4

    asyncio.run(scenario())


def test_refusals_name_the_reason_and_the_numbers() -> None:
    async def scenario() -> None:
        gate = SequenceGate(8, max_waiting=0)
        with pytest.raises(ApiError) as too_many:
            await gate.admit("a", 8)
        assert too_many.value.status == 400 and "at most 7 at once for one client" in str(
            too_many.value
        )
        await gate.admit("a", 7)
        with pytest.raises(ApiError) as over:
            await gate.admit("a", 1)
        assert over.value.code == "over_share" and "holds 7 of the 8" in str(over.value)
        await gate.admit("b", 1)
        with pytest.raises(ApiError) as full:
            await gate.admit("c", 1)
        assert full.value.code == "queue_full"

    asyncio.run(scenario())


def test_a_waiter_cancelled_just_as_it_was_admitted_gives_the_room_back() -> None:
    async def scenario() -> None:
        gate = SequenceGate(4)
        first = await gate.admit("a", 3)
        await gate.admit("b", 1)
        waiting = asyncio.ensure_future(gate.admit("c", 1))
        await asyncio.sleep(0)
        gate.release(first)  # c is admitted: its future has its result...
        waiting.cancel()  # ...and its handler is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert gate.shares.holding("c") == 0 and gate.shares.in_use == 1

    asyncio.run(scenario())
