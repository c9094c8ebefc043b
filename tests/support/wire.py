"""Helpers shared by the wire tests: configs, transports, a bounded asyncio runner, an echo peer,
proxies.

The ``TamperProxy`` is a real TCP proxy on 127.0.0.1 that sits between a client and a listener,
understands just enough of the protocol to find record boundaries, and lets a test rewrite,
drop, duplicate, reorder, inject or cut records in either direction. The ``RecordingProxy``
changes nothing and keeps every byte, as a passive eavesdropper would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import struct
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from mlxppd.runtime.system import event_loop
from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.handshake import ENVELOPE
from mlxppd.wire.noise import hkdf2
from mlxppd.wire.rdma import RdmaTransport
from mlxppd.wire.rdma_probe import ProbeResult
from mlxppd.wire.record import RECORD_HEADER, record_nonce
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.secret import ClusterSecret
from mlxppd.wire.session import Identity
from mlxppd.wire.tcp import TcpTransport
from mlxppd.wire.transport import Listener, Transport, WireConfig
from tests.support.node_keys import node_key_for, roster_for

T = TypeVar("T")

SECRET_TEXT = "7f3c9a1e5b2d4c6a8e0f1a2b3c4d5e6f"
SECRET = ClusterSecret(SECRET_TEXT.encode(), "test")
OTHER_SECRET = ClusterSecret(b"a-different-secret-of-32-bytes!!", "test")
CLUSTER = "test-cluster"
#: the node ids the wire tests' roster lists (each with its test key); others are refused
KNOWN_NODES = (
    "server", "client", "coordinator", "n", "old-peer", "good-peer",
    *(f"stage-{i}" for i in range(10)),
    *(f"s{s}-r{r}" for s in range(4) for r in range(4)),
)  # fmt: skip
ROSTER = roster_for(KNOWN_NODES)
#: what the rdma backend's probe finds on a host whose io_uring works
ACCELERATED = ProbeResult("linux", "io_uring", "io_uring_setup succeeded", True)


def config(node_id: str, **overrides: Any) -> WireConfig:
    """A node's wire settings; tests shorten the handshake timeout so failures end quickly."""
    settings: dict[str, Any] = {
        "cluster_name": CLUSTER,
        "node_id": node_id,
        "secret": SECRET,
        "node_key": node_key_for(node_id),
        "roster": RosterBook(ROSTER),
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


class ProxyServer:
    """The listening half both proxies share: a loopback server that runs ``on_connection``
    for each client and, on exit, cancels the ones still running."""

    def __init__(
        self,
        on_connection: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    ):
        self._on_connection = on_connection
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.address: tuple[str, int] = ("", 0)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)

    async def stop(self) -> None:
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
        # Our own stop cancels this task; asyncio's start_server would log that as an error.
        with contextlib.suppress(asyncio.CancelledError):
            await self._on_connection(reader, writer)
        self._tasks.discard(task)


class TamperProxy:
    """A TCP proxy that applies ``c2s`` / ``s2c`` to the records after the handshake.

    Handshake envelopes pass untouched (c2s: Noise messages 1 and 3; s2c: message 2, after which
    the verdict is s2c record 0). ``records`` keeps every record seen, per direction, so a test
    can replay or inject one.
    """

    HANDSHAKE_MESSAGES = {"c2s": 2, "s2c": 1}

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
        self._server = ProxyServer(self._relay)

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    async def __aenter__(self) -> TamperProxy:
        await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.stop()

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
            for _ in range(self.HANDSHAKE_MESSAGES[direction]):
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


class RecordingProxy:
    """A TCP proxy that passes every byte unchanged and keeps a copy, per connection and
    direction: what someone on the path could record (``recorded[i]["c2s"]``, ``["s2c"]``)."""

    def __init__(self, upstream: tuple[str, int]):
        self._upstream = upstream
        self.recorded: list[dict[str, bytearray]] = []
        #: connections whose both directions have ended
        self.finished = 0
        self._server = ProxyServer(self._relay)

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    async def __aenter__(self) -> RecordingProxy:
        await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.stop()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        copy = {"c2s": bytearray(), "s2c": bytearray()}
        self.recorded.append(copy)
        with contextlib.suppress(ConnectionError):
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            try:
                # Both directions to their end: a half-closed side still sends its goodbye.
                await asyncio.gather(
                    self._pump(reader, up_writer, copy["c2s"]),
                    self._pump(up_reader, writer, copy["s2c"]),
                )
            finally:
                for w in (writer, up_writer):
                    w.close()
                    with contextlib.suppress(Exception):
                        await w.wait_closed()
                self.finished += 1

    @staticmethod
    async def _pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, copy: bytearray
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                copy += data
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(Exception):
            writer.write_eof()


class KnownEphemerals(TcpTransport):
    """A TCP transport whose handshakes use the ephemeral keys a test hands it, one per
    handshake: the control case of the forward-secrecy tests (what it takes to decrypt)."""

    def __init__(self, config: WireConfig, keys: list[X25519PrivateKey]):
        super().__init__(config)
        self._keys = keys

    def _identity(self) -> Identity:
        return dataclasses.replace(super()._identity(), ephemeral=lambda: self._keys.pop(0))


@dataclasses.dataclass
class Recording:
    """One connection as a ``RecordingProxy`` saw it, cut into handshake messages (their Noise
    bodies) and records (header, ciphertext + tag) per direction."""

    message_1: bytes
    message_2: bytes
    message_3: bytes
    c2s: list[tuple[bytes, bytes]]
    s2c: list[tuple[bytes, bytes]]

    @classmethod
    def parse(cls, c2s: bytes, s2c: bytes) -> Recording:
        def envelope(data: bytes, at: int) -> tuple[bytes, int]:
            body_len = struct.unpack_from(">H", data, at + 8)[0]
            start = at + ENVELOPE.size
            return data[start : start + body_len], start + body_len

        def records(data: bytes, at: int) -> list[tuple[bytes, bytes]]:
            out = []
            while at < len(data):
                header = data[at : at + RECORD_HEADER.size]
                start = at + RECORD_HEADER.size
                end = start + struct.unpack_from(">I", header, 4)[0]
                out.append((header, data[start:end]))
                at = end
            return out

        m1, at = envelope(c2s, 0)
        m3, at = envelope(c2s, at)
        c2s_records = records(c2s, at)
        m2, at = envelope(s2c, 0)
        return cls(m1, m2, m3, c2s_records, records(s2c, at))


def opens(key: bytes, records: list[tuple[bytes, bytes]], first: int = 0) -> list[bytes] | None:
    """The plaintexts of ``records`` (record numbers ``first``, ``first + 1``, ...) under
    ``key``, or None when any of them does not open."""
    aead, plain = AESGCM(key), []
    for sequence, (header, sealed) in enumerate(records, first):
        try:
            plain.append(aead.decrypt(record_nonce(sequence), sealed, header))
        except InvalidTag:
            return None
    return plain


def session_keys(recorded: Recording, ee: bytes, es: bytes, se: bytes, psk: bytes) -> list[bytes]:
    """XXpsk3's session keys rebuilt by hand from a recording: the chaining key starts as the
    protocol name and folds in, in order, both ephemerals (psk handshakes mix them into the
    key), ee, es, se and the PSK; Split is one more HKDF. Everything but ``ee`` is known to
    whoever holds both node keys and the cluster secret. (client-to-server, server-to-client)"""
    ck = b"Noise_XXpsk3_25519_AESGCM_SHA256"
    for ikm in (recorded.message_1[:32], recorded.message_2[:32], ee, es, se, psk):
        ck = hkdf2(ck, ikm)[0]
    return list(hkdf2(ck, b""))
