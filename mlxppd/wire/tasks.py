"""Background asyncio tasks: start them guarded, stop them, race them.

Here, in the lowest layer that may use asyncio, so that wire and every layer above share it.

* ``spawn``: a named task whose failure is logged when it happens, not lost until (or unless)
  someone awaits it.
* ``TaskSet``: tasks that come and go (one per connection, one per long command); a finished
  task leaves the set by itself.
* ``stop_tasks``: cancel (or just wait for) tasks and await them; their cancellation is
  swallowed, their first other exception re-raised unless ``ignore_errors``.
* ``race``: run awaitables until the first one finishes, then cancel and await the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine, Iterator
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["TaskSet", "race", "spawn", "stop_tasks"]


def spawn(coro: Coroutine[Any, Any, T], name: str, *, forever: bool = False) -> asyncio.Task[T]:
    """``asyncio.create_task`` whose exception is logged as soon as the task fails.

    ``forever``: the task is a loop meant to run until cancelled, so ending is logged too.
    """
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(_log_exit_forever if forever else _log_failure)
    return task


def _log_failure(task: asyncio.Task[Any]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("task %s failed: %r", task.get_name(), exc)


def _log_exit_forever(task: asyncio.Task[Any]) -> None:
    if task.cancelled():
        return
    if task.exception() is None:
        log.error("task %s exited unexpectedly", task.get_name())
    else:
        _log_failure(task)


class TaskSet:
    """Tasks started with ``spawn`` and forgotten when they finish; ``close`` stops the rest."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = spawn(coro, name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))  # a copy: tasks leave the set as they finish

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, *, ignore_errors: bool = True) -> None:
        """Cancel every task still running and wait for all of them."""
        await stop_tasks(*self, ignore_errors=ignore_errors)


async def stop_tasks(
    *tasks: asyncio.Future[Any] | None, cancel: bool = True, ignore_errors: bool = False
) -> None:
    """Cancel ``tasks`` (``cancel=False``: they were told to stop some other way) and wait for
    every one of them; ``None`` entries are skipped.

    A task's own cancellation is swallowed. The first other exception, in argument order, is
    raised once all have ended, unless ``ignore_errors``. Cancelling the caller while it waits
    propagates as usual (the tasks then carry on ending on their own).
    """
    pending = [t for t in tasks if t is not None]
    if not pending:
        return
    if cancel:
        for task in pending:
            task.cancel()
    await asyncio.wait(pending)
    if ignore_errors:
        return
    for task in pending:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            raise exc


async def race(*aws: Awaitable[Any], timeout: float | None = None) -> None:
    """Run ``aws`` until the first finishes (or ``timeout`` seconds pass), then cancel and
    await the others. An exception of any of them propagates (the first, in argument order)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await stop_tasks(*tasks)
