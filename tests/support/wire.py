"""Helpers shared by the wire tests: configs, transports, a bounded asyncio runner, an echo peer,
a proxy.

The ``TamperProxy`` is a real TCP proxy on 127.0.0.1 that sits between a client and a listener,
understands just enough of the protocol to find record boundaries, and lets a test rewrite,
drop, duplicate, reorder, inject or cut records in either direction.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from mlxppd.runtime.system import event_loop
from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.handshake import ENVELOPE
from mlxppd.wire.rdma import RdmaTransport
from mlxppd.wire.rdma_probe import ProbeResult
from mlxppd.wire.record import RECORD_HEADER
from mlxppd.wire.secret import ClusterSecret
from mlxppd.wire.transport import Listener, Transport, WireConfig

T = TypeVar("T")

SECRET_TEXT = "7f3c9a1e5b2d4c6a8e0f1a2b3c4d5e6f"
SECRET = ClusterSecret(SECRET_TEXT.encode(), "test")
OTHER_SECRET = ClusterSecret(b"a-different-secret-of-32-bytes!!", "test")
CLUSTER = "test-cluster"
#: what the rdma backend's probe finds on a host whose io_uring works
ACCELERATED = ProbeResult("linux", "io_uring", "io_uring_setup succeeded", True)


def config(node_id: str, **overrides: Any) -> WireConfig:
    """A node's wire settings; tests shorten the handshake timeout so failures end quickly."""
    settings: dict[str, Any] = {
        "cluster_name": CLUSTER,
        "node_id": node_id,
        "secret": SECRET,
        "handshake_timeout_s": 5.0,
    }
    settings.update(overrides)
    return WireConfig(**settings)


def backend_transport(backend: str = "tcp", node_id: str = "server", **overrides: Any) -> Transport:
    """A transport of ``backend`` (``rdma``: its fast path, as on a host whose probe passed)."""
    if backend == "rdma":
        return RdmaTransport(config(node_id, **overrides), probe=lambda: ACCELERATED)
    return create_transport(backend, config(node_id, **overrides))


def run(factory: Callable[[], Coroutine[Any, Any, T]], timeout: float = 120.0) -> T:
    """Run a test scenario on a fresh event loop, bounded in time; fail on leaked tasks.

    The loop is the one mlxppd runs on (uvloop where installed); ``MLXPP_EVENT_LOOP=asyncio``
    runs the same scenarios on asyncio's loop (scripts/test.sh does both for the wire tests).
    """

    async def main() -> T:
        async with asyncio.timeout(timeout):
            result = await factory()
        for _ in range(3):  # let close callbacks scheduled by the scenario run
            await asyncio.sleep(0)
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not leftover, f"the scenario left tasks behind: {leftover}"
        return result

    return event_loop.run(main())


async def echo(channel: SecureChannel) -> None:
    """A listener handler that answers every message with a REPLY carrying the same data."""
    async for message in channel:
        await channel.send(MessageKind.REPLY, message.meta, message.tensor)


async def assert_serving(listener: Listener, backend: str = "tcp") -> None:
    """A well-behaved peer can still connect to ``listener`` and get an answer."""
    client = create_transport(backend, config("good-peer"))
    channel = await client.connect(*listener.address)
    try:
        await channel.send(MessageKind.CONTROL, {"ping": 1})
        reply = await channel.recv()
        assert reply.kind is MessageKind.REPLY and reply.meta == {"ping": 1}
    finally:
        await channel.close()


async def eventually(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait until ``condition()`` holds (the other end of a socket acts on its own time)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


class Cut:
    """Returned by a tamper function: send nothing more and close the connection."""


CUT = Cut()
#: tamper(index, record) -> what to send instead (bytes pieces, optionally ending with CUT)
Tamper = Callable[[int, bytes], list[bytes | Cut]]


def flip_bit(data: bytes, offset: int, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[offset] ^= 1 << bit
    return bytes(out)


class TamperProxy:
    """A TCP proxy that applies ``c2s`` / ``s2c`` to the records after the handshake.

    Handshake envelopes pass untouched (two per direction). ``records`` keeps every record seen,
    per direction, so a test can replay or inject one.
    """

    HANDSHAKE_MESSAGES = 2  # c2s: hello, proof; s2c: hello, proof

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        c2s: Tamper | None = None,
        s2c: Tamper | None = None,
    ):
        self._upstream = upstream
        self._tamper = {"c2s": c2s, "s2c": s2c}
        self.records: dict[str, list[bytes]] = {"c2s": [], "s2c": []}
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.address: tuple[str, int] = ("", 0)

    async def __aenter__(self) -> TamperProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        # Our own __aexit__ cancels this task; asyncio's start_server would log that as an error.
        with contextlib.suppress(asyncio.CancelledError):
            await self._relay(reader, writer)
        self._tasks.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, "c2s")),
            asyncio.create_task(self._pump(up_reader, writer, "s2c")),
        ]
        try:
            # Whichever direction ends first ends the connection, as a real cut would.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            for _ in range(self.HANDSHAKE_MESSAGES):
                envelope = await reader.readexactly(ENVELOPE.size)
                body_len = struct.unpack_from(">H", envelope, 8)[0]
                writer.write(envelope + await reader.readexactly(body_len))
            index = 0
            tamper = self._tamper[direction]
            while True:
                header = await reader.readexactly(RECORD_HEADER.size)
                sealed_len = struct.unpack_from(">I", header, 4)[0]
                record = header + await reader.readexactly(sealed_len)
                self.records[direction].append(record)
                pieces: list[bytes | Cut] = tamper(index, record) if tamper else [record]
                index += 1
                for piece in pieces:
                    if isinstance(piece, Cut):
                        await writer.drain()
                        return
                    writer.write(piece)
                await writer.drain()


async def serve(
    transport: Transport, handler: Callable[[SecureChannel], Awaitable[None]] = echo
) -> Listener:
    """``transport`` listening on an ephemeral loopback port."""
    return await transport.listen("127.0.0.1", 0, handler)
