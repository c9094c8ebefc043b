"""Byte streams under a secure channel: the interface, and asyncio streams (tcp).

The channel owns the cryptography and the framing; a stream only moves bytes. Every stream
offers the same small interface, so the one channel implementation runs over any of them:

* ``AsyncioByteStream`` (here) wraps asyncio's StreamReader/StreamWriter: the ``tcp`` backend,
  and a fast-path connection whose peer did not negotiate the fast path.
* ``SocketByteStream`` (``socket_stream``) drives a socket directly with preallocated buffers;
  the ``rdma`` backend's fast path.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

__all__ = [
    "CHUNK_BYTES",
    "STREAM_LIMIT",
    "AsyncioByteStream",
    "Buffer",
    "ByteStream",
    "StreamEOF",
    "advance_buffers",
    "format_address",
]

#: Size of the pieces large records are encrypted, sent and decrypted in: big enough to keep
#: per-call overhead small, small enough to stay in cache between the cipher and the kernel.
CHUNK_BYTES = 1024 * 1024
#: asyncio StreamReader buffer limit: larger than the default 64 KiB, so a large record does
#: not pause and resume the transport every 128 KiB.
STREAM_LIMIT = 4 * CHUNK_BYTES

Buffer = bytes | bytearray | memoryview


class StreamEOF(Exception):
    """The peer closed the connection; ``received`` bytes of the current read had arrived."""

    def __init__(self, received: int = 0):
        self.received = received
        super().__init__(f"connection closed after {received} bytes of a read")


def format_address(addr: object) -> str:
    """``host:port`` (``[v6]:port``) of a socket address tuple, or ``?`` when unknown."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return "?"


def advance_buffers(buffers: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of a scatter-gather list after ``sent`` bytes went out (pure)."""
    out = []
    for buf in buffers:
        if sent >= len(buf):
            sent -= len(buf)
            continue
        out.append(buf[sent:])
        sent = 0
    return out


class ByteStream(ABC):
    """A connected, ordered, reliable byte stream to one peer."""

    #: the peer's address as ``host:port``, for log lines and per-peer state
    peer: str
    #: preferred size of one encrypted piece of a large record
    chunk_size: int = CHUNK_BYTES

    @abstractmethod
    async def read_exactly(self, n: int) -> bytes | memoryview:
        """Exactly ``n`` bytes, valid until the caller next awaits. Raises ``StreamEOF``."""

    @abstractmethod
    async def read_through(self, n: int, sink: Callable[[memoryview], None]) -> None:
        """Pass exactly ``n`` bytes to ``sink`` in pieces, as they arrive (views valid only
        during the call). Raises ``StreamEOF`` with the count of bytes delivered."""

    @abstractmethod
    def scratch(self, n: int) -> memoryview:
        """Writable memory for the next ``write``; may be reused once ``write`` returns."""

    @abstractmethod
    async def write(self, parts: Sequence[Buffer]) -> None:
        """Send every byte of ``parts``, in order."""

    @abstractmethod
    def close(self) -> None:
        """Start closing; pending reads end with ``StreamEOF``."""

    @abstractmethod
    async def wait_closed(self) -> None:
        """Wait until the connection is closed."""


class AsyncioByteStream(ByteStream):
    """A stream over asyncio's StreamReader/StreamWriter (the ``tcp`` backend)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer
        self.peer = format_address(writer.get_extra_info("peername"))
        # drain() then waits until the transport holds none of our bytes (it may keep views of
        # them, Python 3.12+), so one send buffer can be reused instead of fresh memory.
        writer.transport.set_write_buffer_limits(high=0)
        self._send_arena = memoryview(bytearray(0))

    @classmethod
    async def from_socket(cls, sock: socket.socket) -> AsyncioByteStream:
        """Wrap an already connected socket (used when a peer falls back from the fast path)."""
        reader, writer = await asyncio.open_connection(sock=sock, limit=STREAM_LIMIT)
        return cls(reader, writer)

    async def read_exactly(self, n: int) -> bytes | memoryview:
        try:
            return await self._reader.readexactly(n)
        except asyncio.IncompleteReadError as exc:
            raise StreamEOF(len(exc.partial)) from None
        except ConnectionError:
            raise StreamEOF(0) from None

    async def read_through(self, n: int, sink: Callable[[memoryview], None]) -> None:
        done = 0
        while done < n:
            try:
                data = await self._reader.read(min(n - done, CHUNK_BYTES))
            except ConnectionError:
                data = b""
            if not data:
                raise StreamEOF(done)
            sink(memoryview(data))
            done += len(data)

    def scratch(self, n: int) -> memoryview:
        if n > len(self._send_arena):  # grows to the largest piece the channel writes
            self._send_arena = memoryview(bytearray(max(n, 64 * 1024)))
        return self._send_arena[:n]

    async def write(self, parts: Sequence[Buffer]) -> None:
        for part in parts:
            self._writer.write(part)
        await self._writer.drain()  # returns once the transport holds none of ``parts``

    def close(self) -> None:
        self._writer.close()

    async def wait_closed(self) -> None:
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
