"""Background task helpers (mlxppd.wire.tasks): guarded start, stop, race."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mlxppd.wire.tasks import TaskSet, race, spawn, stop_tasks
from tests.support.wire import run


async def _forever() -> None:
    await asyncio.Event().wait()


async def _fail(after_s: float = 0.0) -> None:
    await asyncio.sleep(after_s)
    raise RuntimeError("boom")


def test_a_failing_task_is_logged_when_it_fails(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        task = spawn(_fail(), name="doomed")
        await asyncio.sleep(0.01)
        assert "task doomed failed: RuntimeError('boom')" in caplog.text
        with pytest.raises(RuntimeError):  # still raised to whoever stops it
            await stop_tasks(task)

    with caplog.at_level(logging.ERROR, logger="mlxppd.wire.tasks"):
        run(scenario)


def test_a_forever_task_that_returns_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        task = spawn(asyncio.sleep(0), name="loop", forever=True)
        await stop_tasks(task, cancel=False)

    with caplog.at_level(logging.ERROR, logger="mlxppd.wire.tasks"):
        run(scenario)
    assert "task loop exited unexpectedly" in caplog.text


def test_cancelling_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        await stop_tasks(spawn(_forever(), name="quiet", forever=True), None)

    with caplog.at_level(logging.ERROR, logger="mlxppd.wire.tasks"):
        run(scenario)
    assert caplog.text == ""


def test_stop_tasks_waits_for_all_then_raises_the_first_error() -> None:
    async def scenario() -> None:
        slow_done = asyncio.Event()

        async def slow() -> None:
            try:
                await _forever()
            finally:
                await asyncio.sleep(0.01)
                slow_done.set()

        failing = spawn(_fail(), name="failing")
        running = spawn(slow(), name="slow")
        await asyncio.wait([failing])
        with pytest.raises(RuntimeError):
            await stop_tasks(failing, running)
        assert slow_done.is_set()
        await stop_tasks(failing, ignore_errors=True)  # and quietly when asked

    run(scenario)


def test_task_set_forgets_finished_tasks_and_closes_the_rest() -> None:
    async def scenario() -> None:
        tasks = TaskSet()
        tasks.spawn(asyncio.sleep(0), name="short")
        long = tasks.spawn(_forever(), name="long")
        tasks.spawn(_fail(0.01), name="failing")
        await asyncio.sleep(0.05)
        assert list(tasks) == [long]
        await tasks.close()
        assert long.cancelled() and len(tasks) == 0

    run(scenario)


def test_race_cancels_the_losers_and_propagates_errors() -> None:
    async def scenario() -> None:
        stop = asyncio.Event()
        stop.set()
        cancelled = asyncio.Event()

        async def work() -> None:
            try:
                await _forever()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        await race(work(), stop.wait())
        assert cancelled.is_set()
        await race(_forever(), timeout=0.01)  # a timeout ends it too
        with pytest.raises(RuntimeError):
            await race(_fail(), _forever())

    run(scenario)
