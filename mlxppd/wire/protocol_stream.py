"""The ``tcp`` backend's byte stream: an asyncio transport that receives into one arena.

asyncio's transport drives the socket (so it runs on any event loop); as a
``BufferedProtocol`` it ``recv_into``s this stream's arena (small until the handshake is
accepted, then preallocated at full size: ``open_buffers``) instead of handing over
a fresh bytes object per read, and readers get views of the arena. That is one copy fewer
than asyncio's StreamReader (which joins reads into its own buffer, then slices out bytes) and
lets a decode step's record be opened straight from where the kernel put it.

Sending goes through ``transport.write``. With the transport's high-water mark at 0, the
protocol is paused whenever the kernel did not take a write whole; ``write`` then waits until
the transport holds none of our bytes, and ``scratch`` hands out fresh memory instead of the
send arena while it holds any, so a buffer the transport still refers to is never reused.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import cast

from mlxppd.wire.arena_stream import ArenaStream
from mlxppd.wire.streams import CHUNK_BYTES, Buffer, StreamEOF, format_address, format_host

__all__ = ["ProtocolByteStream"]


class ProtocolByteStream(ArenaStream, asyncio.BufferedProtocol):
    """A stream over an asyncio transport, receiving into a preallocated arena."""

    def __init__(
        self,
        *,
        arena_bytes: int = CHUNK_BYTES,
        on_connected: Callable[[ProtocolByteStream], None] | None = None,
    ):
        self._on_connected = on_connected
        self.peer = "?"
        self._init_arena(arena_bytes)
        self._transport: asyncio.Transport | None = None
        self._eof = False
        self._reading_paused = False
        self._writing_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._closed = asyncio.Event()

    @classmethod
    async def from_socket(
        cls, sock: socket.socket, *, arena_bytes: int = CHUNK_BYTES
    ) -> ProtocolByteStream:
        """Wrap an already connected socket (a peer that falls back from the fast path), whose
        handshake was accepted: its buffers are full-size at once."""
        loop = asyncio.get_running_loop()
        _, stream = await loop.connect_accepted_socket(
            lambda: cls(arena_bytes=arena_bytes), sock=sock
        )
        stream.open_buffers()
        return stream

    # -- protocol callbacks (the event loop calls these) -----------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but offer the same methods.
        self._transport = stream_transport = cast(asyncio.Transport, transport)
        peername = stream_transport.get_extra_info("peername")
        self.peer, self.peer_host = format_address(peername), format_host(peername)
        stream_transport.set_write_buffer_limits(high=0)
        if self._on_connected is not None:
            self._on_connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        # Runs only while the reading task is suspended, so moving unread bytes is safe.
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._arena):
            self._compact()
        return self._arena[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        if self._end == len(self._arena) and self._start == 0 and self._transport is not None:
            self._transport.pause_reading()  # full: the reader resumes it once it drains
            self._reading_paused = True
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._wake()
        self._writing_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)
        self._closed.set()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    def open_buffers(self) -> None:
        if self._grow_arena() and self._reading_paused and self._transport is not None:
            self._reading_paused = False  # the small arena had filled up: there is room now
            self._transport.resume_reading()

    # -- reading ------------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait_for_data(self) -> None:
        if self._eof:
            raise StreamEOF(self._end - self._start)
        if self._reading_paused and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def _fill(self, want: int) -> None:
        await self._wait_for_data()

    # -- writing ------------------------------------------------------------------------------

    def scratch(self, n: int) -> memoryview:
        transport = self._transport
        if transport is not None and transport.get_write_buffer_size():
            return memoryview(bytearray(n))  # the transport may still refer to the arena
        if n > len(self._send_arena):  # grows to the largest piece the channel writes
            self._send_arena = memoryview(bytearray(max(n, 64 * 1024)))
        return self._send_arena[:n]

    def write_nowait(self, data: memoryview) -> int:
        transport = self._transport
        if transport is None or transport.is_closing() or self._writing_paused:
            return 0  # closed, or earlier bytes still queued: ``write`` waits for room
        transport.write(data)
        return len(data)

    async def write(self, parts: Sequence[Buffer]) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the stream is closed")
        for part in parts:
            transport.write(part)
        while self._writing_paused:  # returns once the transport holds none of ``parts``
            if transport.is_closing():
                raise ConnectionResetError("the stream is closed")
            self._drain_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._drain_waiter
            finally:
                self._drain_waiter = None
            if self._closed.is_set():
                raise ConnectionResetError("the connection was lost while sending")

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._eof = True
        self._wake()

    async def wait_closed(self) -> None:
        await self._closed.wait()
