"""The fast path's byte stream: a non-blocking socket with preallocated ("registered") buffers.

Both arenas are allocated at full size only once the handshake is accepted (``open_buffers``);
until then the receive arena is ``HANDSHAKE_BUFFER_BYTES`` and there is no send arena.

* Receive: one arena per connection. After the handshake the socket stays registered with the
  event loop, and every readiness callback does one ``recv_into`` straight into the arena's free
  space (read-ahead), so a small record costs one system call and one task wake-up. Readers
  get views of the arena; large records stream through it to the cipher.
* Send: one arena per connection, filled by the cipher and written with ``sendmsg``
  scatter-gather (record header, ciphertext, tag) in one call; it is reused as soon as the kernel
  has taken the bytes, because ``write`` only returns then.

Before ``enable_readahead()`` (that is, during the handshake) reads take exactly the bytes asked
for: if the peer does not negotiate the fast path, the socket is handed to an asyncio transport
(``detach``) with no byte of the peer's stream left behind in our arena.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence

from mlxppd.wire.arena_stream import ArenaStream
from mlxppd.wire.streams import (
    CHUNK_BYTES,
    Buffer,
    StreamEOF,
    advance_buffers,
    format_address,
    format_host,
)

__all__ = ["SocketByteStream"]


class SocketByteStream(ArenaStream):
    """A stream over a connected non-blocking socket with preallocated arenas."""

    def __init__(self, sock: socket.socket, *, arena_bytes: int = CHUNK_BYTES):
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock: socket.socket | None = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        peername = sock.getpeername()
        self.peer, self.peer_host = format_address(peername), format_host(peername)
        self._init_arena(arena_bytes)  # the send arena waits for ``open_buffers``
        self._readahead = False
        self._registered = False  # the read-ahead callback is registered with the loop
        self._eof = False
        self._waiter: asyncio.Future[None] | None = None
        self._write_waiter: asyncio.Future[None] | None = None
        self._busy = 0  # exact-mode reads/writes in flight (they hold loop registrations)
        self._closing = False
        self._closed = asyncio.Event()

    # -- modes --------------------------------------------------------------------------------

    def open_buffers(self) -> None:
        self._grow_arena()
        if len(self._send_arena) < self.chunk_size:
            self._send_arena = memoryview(bytearray(self.chunk_size))

    def enable_readahead(self) -> None:
        """Keep the socket registered and read ahead into the arena (after the handshake)."""
        if self._readahead or self._sock is None:
            return
        self._readahead = True
        self._register()

    def detach(self) -> socket.socket:
        """Give up the socket; only before read-ahead, when no unread byte can be buffered."""
        if self._sock is None or self._readahead or self._start != self._end or self._busy:
            raise RuntimeError("cannot detach a closed, busy or read-ahead stream")
        sock, self._sock = self._sock, None
        self._closed.set()
        return sock

    # -- read-ahead ---------------------------------------------------------------------------

    def _register(self) -> None:
        if not self._registered and not self._eof and self._sock is not None:
            self._loop.add_reader(self._fd, self._on_readable)
            self._registered = True

    def _unregister(self) -> None:
        if self._registered:
            self._loop.remove_reader(self._fd)
            self._registered = False

    def _on_readable(self) -> None:
        # Runs only while the reading task is suspended, so moving unread bytes is safe.
        if self._end == len(self._arena):
            self._compact()
            if self._end == len(self._arena):  # full: the reader re-registers once it drains
                self._unregister()
                return
        sock = self._sock
        assert sock is not None
        try:
            n = sock.recv_into(self._arena[self._end :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n == 0:
            self._eof = True
            self._unregister()
        else:
            self._end += n
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait_for_data(self) -> None:
        if self._eof or self._closing:
            raise StreamEOF(self._end - self._start)
        self._register()  # in case a full arena had paused us
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- reading ------------------------------------------------------------------------------

    async def _fill(self, want: int) -> None:
        if self._readahead:
            await self._wait_for_data()
            return
        k = await self._recv_exact(self._arena[self._end : self._end + want])
        if k == 0:
            raise StreamEOF(self._end - self._start)
        self._end += k

    async def _recv_exact(self, view: memoryview) -> int:
        """One ``recv_into`` through the loop (handshake mode); 0 at end of stream."""
        sock = self._sock
        if sock is None or self._closing:
            return 0
        self._busy += 1
        try:
            return await self._loop.sock_recv_into(sock, view)
        except (ConnectionError, OSError):
            return 0
        finally:
            self._busy -= 1
            self._release_if_idle()

    # -- writing ------------------------------------------------------------------------------

    def scratch(self, n: int) -> memoryview:
        if n <= len(self._send_arena):
            return self._send_arena[:n]
        return memoryview(bytearray(n))

    def write_nowait(self, data: memoryview) -> int:
        # The fast path of every small record: one send the kernel usually takes whole.
        sock = self._sock
        if sock is None or self._closing or self._busy:
            return 0  # closed, or a write is waiting for room: it goes first
        try:
            return sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0

    async def write(self, parts: Sequence[Buffer]) -> None:
        pending = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
        self._busy += 1
        try:
            while pending:
                sock = self._sock
                if sock is None or self._closing:
                    raise ConnectionResetError("the stream is closed")
                try:
                    sent = sock.sendmsg(pending)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                pending = advance_buffers(pending, sent)
                if pending:
                    await self._wait_writable()
        finally:
            self._busy -= 1
            self._release_if_idle()

    async def _wait_writable(self) -> None:
        # Registered only while the socket buffer is full, so bulk sends pay for it, not RPCs.
        self._write_waiter = self._loop.create_future()
        waiter = self._write_waiter

        def ready() -> None:
            if not waiter.done():
                waiter.set_result(None)

        self._loop.add_writer(self._fd, ready)
        try:
            await waiter
        finally:
            self._write_waiter = None
            if self._sock is not None:
                self._loop.remove_writer(self._fd)

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        if self._sock is None or self._closing:
            return
        self._closing = True
        self._unregister()
        for waiter in (self._waiter, self._write_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)  # the woken task sees _closing and stops
        # shutdown() also wakes an exact-mode recv pending in the loop with end of stream.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        # The fd is closed only once no loop registration of an operation still refers to it.
        if self._closing and self._busy == 0 and self._sock is not None:
            self._sock.close()
            self._sock = None
            self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()
