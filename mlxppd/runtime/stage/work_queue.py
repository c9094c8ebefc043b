"""A stage's queue of work for its compute loop: arrival order, but prefill does not stall
decode.

A long prompt arrives as many prefill chunks back to back (``core/prefill_chunks.py``). Run in
arrival order, every decode step that comes in meanwhile would wait for all of them: each
running stream would freeze for the whole prefill. So after each chunk the decode steps then
waiting run first, then the next chunk: the streams wait at most one chunk per step, and the
prompt still advances one chunk per round.

Only decode steps move, and only ahead of prefill chunks: never past a release, a forget, a
layer swap or the coordinator's loss (barriers), never ahead of their own sequence's chunks
(nor ahead of the chunk whose caches a choice sharing the prompt's prefill copies).
A sequence's decode step cannot be queued while its prefill is (its first token is sampled
after its last chunk), so nothing runs out of its sequence's order.
"""

from __future__ import annotations

import asyncio
from collections import deque

from mlxppd.runtime.stage.work import ForwardWork, GroupWork, Work


def _is_chunk(item: Work) -> bool:
    return isinstance(item, ForwardWork) and not item.meta.sample


def _is_step(item: Work) -> bool:
    return isinstance(item, GroupWork) or (isinstance(item, ForwardWork) and item.meta.sample)


class WorkQueue:
    def __init__(self) -> None:
        self._items: deque[Work] = deque()
        self._more = asyncio.Event()
        # Decode steps that may still go ahead of the next chunk (counted after each chunk).
        self._credit = 0
        self._after_chunk = False
        #: decode steps run ahead of a chunk that arrived before them
        self.overtakes = 0

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Work) -> None:
        self._items.append(item)
        self._more.set()

    async def put(self, item: Work) -> None:
        self.put_nowait(item)

    async def get(self) -> Work:
        while not self._items:
            self._more.clear()
            await self._more.wait()
        steps = self._steps() if self._after_chunk or self._credit else []
        if self._after_chunk:
            # The chunk is done: the steps waiting now run before the next one.
            self._after_chunk = False
            self._credit = len(steps)
        if steps:
            self._credit -= 1
            item = self._items[steps[0]]
            del self._items[steps[0]]
            if steps[0]:
                self.overtakes += 1
        else:
            self._credit = 0
            item = self._items.popleft()
        self._after_chunk = _is_chunk(item)
        return item

    def _steps(self) -> list[int]:
        """Where the decode steps are that may run before the chunks queued ahead of them."""
        found, chunked = [], set()
        for i, item in enumerate(self._items):
            if _is_chunk(item):
                assert isinstance(item, ForwardWork)
                chunked.add(item.meta.seq)
                # A choice sharing this prefill starts from the copy this chunk makes: its
                # first input must not run before it (it ran on no caches and drew garbage).
                chunked.update(item.meta.forks or ())
            elif _is_step(item):
                seq = item.meta.seq if isinstance(item, ForwardWork) else None
                if seq not in chunked:
                    found.append(i)
            else:
                break  # a barrier: nothing moves past it
        return found
