"""Byte streams under a secure channel: the interface they share.

The channel owns the cryptography and the framing; a stream only moves bytes. Every stream
offers the same small interface, so the one channel implementation runs over any of them:

* ``ProtocolByteStream`` (``protocol_stream``) is an asyncio protocol receiving into an arena:
  the ``tcp`` backend, and a fast-path connection whose peer did not negotiate the fast path.
* ``SocketByteStream`` (``socket_stream``) drives a socket directly with preallocated buffers;
  the ``rdma`` backend's fast path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from mlxppd.core.config.addresses import join_host_port

__all__ = [
    "CHUNK_BYTES",
    "HANDSHAKE_BUFFER_BYTES",
    "Buffer",
    "ByteStream",
    "StreamEOF",
    "advance_buffers",
    "format_address",
    "format_host",
]

#: Size of the pieces large records are encrypted, sent and decrypted in: big enough to keep
#: per-call overhead small, small enough to stay in cache between the cipher and the kernel.
CHUNK_BYTES = 1024 * 1024

#: Receive buffer of a connection until its handshake is accepted: the largest handshake read
#: is a 1024-byte body or a 1024-byte verdict record (plus header and tag), so an
#: unauthenticated peer never makes this process hold more than this per connection.
HANDSHAKE_BUFFER_BYTES = 4096

Buffer = bytes | bytearray | memoryview


class StreamEOF(Exception):
    """The peer closed the connection; ``received`` bytes of the current read had arrived."""

    def __init__(self, received: int = 0):
        self.received = received
        super().__init__(f"connection closed after {received} bytes of a read")


def format_host(addr: object) -> str:
    """The host of a socket address tuple (the key of per-source limits), or ``?``."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        return str(addr[0])
    return "?"


def format_address(addr: object) -> str:
    """``host:port`` (``[v6]:port``) of a socket address tuple, or ``?`` when unknown."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        return join_host_port(str(addr[0]), addr[1])
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
    #: the peer's host alone, what per-source limits count by
    peer_host: str = "?"
    #: preferred size of one encrypted piece of a large record
    chunk_size: int = CHUNK_BYTES

    def open_buffers(self) -> None:
        """The handshake was accepted: allocate the full-size buffers (until then a stream
        holds at most ``HANDSHAKE_BUFFER_BYTES`` of receive buffer). Idempotent."""
        return None  # a stream without buffers of its own has nothing to grow

    @property
    def buffer_bytes(self) -> int:
        """Bytes of receive and send buffer this stream holds now."""
        return 0

    @abstractmethod
    async def read_exactly(self, n: int) -> memoryview:
        """Exactly ``n`` bytes, valid until the caller next awaits. Raises ``StreamEOF``."""

    def read_nowait(self, n: int) -> memoryview | None:
        """Exactly ``n`` bytes if they are already buffered (valid until the next read), else
        None and nothing consumed. This default never has any."""
        return None

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

    def write_nowait(self, data: memoryview) -> int:
        """Hand the first bytes of ``data`` to the kernel now, if it takes them without
        waiting; how many it took (``write`` sends the rest). This default takes none."""
        return 0

    @abstractmethod
    def close(self) -> None:
        """Start closing; pending reads end with ``StreamEOF``."""

    @abstractmethod
    async def wait_closed(self) -> None:
        """Wait until the connection is closed."""
