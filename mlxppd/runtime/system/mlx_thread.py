"""The one thread per process that runs mlx work, fed by a queue.

The event loop never blocks on mlx: it submits a function and awaits an asyncio future. An
exception in the function travels back as a value and is raised in the awaiting coroutine.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()


class MlxThread:
    def __init__(self, name: str = "mlx") -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            loop, future, fn = item
            try:
                result = fn()
            except BaseException as exc:  # travels back as a value
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, future, fn))
        return future

    async def run(self, fn: Callable[[], T]) -> T:
        return await self.submit(fn)

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
