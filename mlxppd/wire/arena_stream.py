"""Reading from one preallocated receive buffer (the arena), shared by both socket streams.

The kernel's bytes land in the arena; readers get views of it (valid until their next read or
await), records too large for it stream through it in pieces. Subclasses only say how more
bytes arrive (``_fill``): ``SocketByteStream`` from its own readiness callback or one exact
``recv_into``, ``ProtocolByteStream`` from asyncio's transport.

Until the handshake is accepted the arena is ``HANDSHAKE_BUFFER_BYTES`` (every handshake read
fits); ``open_buffers()`` then grows it to its full size, keeping any unread bytes.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

from mlxppd.wire.streams import HANDSHAKE_BUFFER_BYTES, ByteStream, StreamEOF

__all__ = ["ArenaStream"]


class ArenaStream(ByteStream):
    """A byte stream whose unread bytes are ``_arena[_start:_end]``."""

    #: what the stream sends from (subclasses size it; empty before ``open_buffers``)
    _send_arena: memoryview

    def _init_arena(self, arena_bytes: int) -> None:
        self.chunk_size = arena_bytes
        self._full_arena_bytes = arena_bytes
        # Small until the peer is authenticated: a silent or hostile connection costs little.
        self._arena = memoryview(bytearray(min(arena_bytes, HANDSHAKE_BUFFER_BYTES)))
        self._start = 0  # unread bytes of the arena are [_start, _end)
        self._end = 0
        self._send_arena = memoryview(bytearray(0))

    def _grow_arena(self) -> bool:
        """Grow the arena to its full size, keeping unread bytes; True when it grew.

        Only between a reader's awaits (the caller holds no view into the arena then).
        """
        if len(self._arena) >= self._full_arena_bytes:
            return False
        unread = self._end - self._start
        arena = memoryview(bytearray(self._full_arena_bytes))
        arena[:unread] = self._arena[self._start : self._end]
        self._arena, self._start, self._end = arena, 0, unread
        return True

    @property
    def buffer_bytes(self) -> int:
        return len(self._arena) + len(self._send_arena)

    @abstractmethod
    async def _fill(self, want: int) -> None:
        """Wait until more bytes follow ``_end`` (at most ``want`` more if the stream only reads
        what it is asked for). Raises ``StreamEOF`` at end of stream."""

    def _compact(self) -> None:
        # Only between a reader's awaits: it holds no view into the arena then.
        unread = self._end - self._start
        if self._start:
            self._arena[:unread] = self._arena[self._start : self._end]
            self._start, self._end = 0, unread

    def read_nowait(self, n: int) -> memoryview | None:
        start = self._start
        if self._end - start < n:
            return None
        self._start = start + n
        return self._arena[start : start + n]

    async def read_exactly(self, n: int) -> memoryview:
        if n > len(self._arena):  # larger than the arena: gather into fresh memory
            out = memoryview(bytearray(n))
            pos = 0

            def gather(chunk: memoryview) -> None:
                nonlocal pos
                out[pos : pos + len(chunk)] = chunk
                pos += len(chunk)

            try:
                await self.read_through(n, gather)
            except StreamEOF:
                raise StreamEOF(pos) from None
            return out
        if len(self._arena) - self._start < n:
            self._compact()
        while self._end - self._start < n:
            try:
                await self._fill(self._start + n - self._end)
            except StreamEOF:
                raise StreamEOF(self._end - self._start) from None
        self._start += n
        return self._arena[self._start - n : self._start]

    async def read_through(self, n: int, sink: Callable[[memoryview], None]) -> None:
        done = 0
        while done < n:
            if self._start == self._end:
                self._start = self._end = 0
                try:
                    await self._fill(min(n - done, len(self._arena)))
                except StreamEOF:
                    raise StreamEOF(done) from None
                continue
            take = min(n - done, self._end - self._start)
            sink(self._arena[self._start : self._start + take])
            self._start += take
            done += take
