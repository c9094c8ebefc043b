"""What a stage port gives a peer that has not authenticated: a small buffer, a slot among a few
handshakes, and ``handshake_timeout_s``; connections beyond the caps are closed unread.

Real sockets on loopback against a real listener; nothing of the wire layer is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import struct
import sys
import tracemalloc
from pathlib import Path

import pytest

from mlxppd.core.errors import ConfigurationError, TemporaryError
from mlxppd.core.log_text import quoted
from mlxppd.wire.codec import MESSAGE_HEADER, MessageAssembler, MessageKind
from mlxppd.wire.dtypes import dtype_by_name
from mlxppd.wire.errors import HandshakeError, HandshakeFailure, PreauthRefusal
from mlxppd.wire.handshake import (
    HandshakeType,
    Hello,
    decode_hello,
    encode_hello,
    pack_envelope,
    prologue,
)
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.noise import NoiseHandshake
from mlxppd.wire.preauth import source_of
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.streams import CHUNK_BYTES, HANDSHAKE_BUFFER_BYTES
from mlxppd.wire.transport import WireConfig
from mlxppd.wire.version import PROTOCOL_VERSION
from tests.support.node_keys import node_key_for
from tests.support.paths import REPO_ROOT
from tests.support.wire import (
    ROSTER,
    SECRET,
    assert_serving,
    backend_transport,
    eventually,
    run,
    serve,
)

pytestmark = pytest.mark.timeout(60)


class Silent:
    """A raw TCP connection that sends nothing (or what a test writes on it)."""

    def __init__(self) -> None:
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    @classmethod
    async def open(cls, address: tuple[str, int], source: str = "127.0.0.1") -> Silent:
        conn = cls()
        conn.reader, conn.writer = await asyncio.open_connection(*address, local_addr=(source, 0))
        return conn

    async def closed_by_peer(self) -> bool:
        """Whether the other end closed (end of stream or reset), without waiting long."""
        assert self.reader is not None
        try:
            async with asyncio.timeout(0.05):
                return await self.reader.read(1) == b""
        except TimeoutError:
            return False
        except ConnectionError:
            return True

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()


async def until_closed(conns: list[Silent]) -> None:
    async with asyncio.timeout(30):
        for conn in conns:
            while not await conn.closed_by_peer():
                pass


async def close_all(conns: list[Silent]) -> None:
    for conn in conns:
        await conn.close()


# -- the caps ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tcp", "rdma"])
def test_handshakes_beyond_the_global_cap_are_closed_unread_and_counted(backend: str) -> None:
    async def scenario() -> None:
        transport = backend_transport(backend, max_handshakes=3, max_handshakes_per_source=100)
        async with await serve(transport) as listener:
            held = [await Silent.open(listener.address) for _ in range(3)]
            await eventually(lambda: listener.handshakes.in_progress == 3)
            extra = [await Silent.open(listener.address) for _ in range(2)]
            await until_closed(extra)
            refused = transport.stats.preauth_refused
            assert refused == {PreauthRefusal.HANDSHAKES_IN_PROGRESS: 2}
            assert transport.stats.snapshot()["preauth_refused"] == {"handshakes_in_progress": 2}
            assert not any([await c.closed_by_peer() for c in held])  # the first three wait on
            await close_all(held + extra)
            # Slots come back when their handshakes end; a real peer gets in again.
            await eventually(lambda: listener.handshakes.in_progress == 0)
            await assert_serving(listener, backend="tcp")

    run(scenario)


def test_handshakes_beyond_the_per_source_cap_are_closed_while_other_sources_get_in() -> None:
    async def scenario() -> None:
        transport = backend_transport(max_handshakes=10, max_handshakes_per_source=2)
        async with await serve(transport) as listener:
            held = [await Silent.open(listener.address) for _ in range(2)]
            await eventually(lambda: listener.handshakes.in_progress_from("127.0.0.1") == 2)
            extra = await Silent.open(listener.address)
            await until_closed([extra])
            assert transport.stats.preauth_refused == {PreauthRefusal.HANDSHAKES_FROM_SOURCE: 1}
            try:  # another loopback address is another source (Linux routes all of 127/8)
                other = await Silent.open(listener.address, source="127.0.0.2")
            except OSError:
                other = None
            if other is not None:
                await eventually(lambda: listener.handshakes.in_progress_from("127.0.0.2") == 1)
                assert not await other.closed_by_peer()
                await other.close()
            assert transport.stats.preauth_refused == {PreauthRefusal.HANDSHAKES_FROM_SOURCE: 1}
            await close_all([*held, extra])
            await eventually(lambda: listener.handshakes.in_progress == 0)
            await assert_serving(listener)

    run(scenario)


def test_sources_are_addresses_and_ipv6_sources_their_64_prefix() -> None:
    assert source_of("10.0.0.7") == "10.0.0.7"
    assert source_of("2001:db8:1:2:aaaa::1") == source_of("2001:db8:1:2:bbbb::9")
    assert source_of("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert source_of("2001:db8:1:3::1") != source_of("2001:db8:1:2::1")
    assert source_of("::ffff:10.0.0.7") == "10.0.0.7"  # an IPv4 peer on a dual-stack socket
    assert source_of("fe80::1%eth0") == "fe80::/64"
    assert source_of("?") == "?"


def test_the_defaults_are_the_documented_caps() -> None:
    defaults = wire_config("c", "n")
    assert (defaults.max_handshakes, defaults.max_handshakes_per_source) == (64, 8)
    assert defaults.handshake_timeout_s == 10.0
    assert HANDSHAKE_BUFFER_BYTES == 4096
    assert "`max_handshakes` (64)" in PROTOCOL_DOC and "`max_handshakes_per_source` (8)" in (
        PROTOCOL_DOC
    )


PROTOCOL_DOC = (REPO_ROOT / "docs" / "protocol.md").read_text()


def wire_config(cluster_name: str, node_id: str) -> WireConfig:
    """A config with nothing but what is required, so the defaults show."""
    return WireConfig(cluster_name, node_id, SECRET, node_key_for("n"), RosterBook(ROSTER))


# -- the timeout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tcp", "rdma"])
def test_a_silent_connection_is_dropped_at_the_handshake_timeout(backend: str) -> None:
    async def scenario() -> None:
        transport = backend_transport(backend, handshake_timeout_s=0.2)
        async with await serve(transport) as listener:
            silent = await Silent.open(listener.address)
            await until_closed([silent])
            await eventually(lambda: transport.stats.handshake_failures["timeout"] == 1)
            await eventually(lambda: listener.handshakes.in_progress == 0)
            await silent.close()

    run(scenario)


# -- memory --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tcp", "rdma"])
def test_an_unauthenticated_connection_holds_a_few_kib_and_an_accepted_one_full_buffers(
    backend: str,
) -> None:
    async def scenario() -> None:
        transport = backend_transport(backend)
        async with await serve(transport, grab) as listener:
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                conns = [await Silent.open(listener.address) for _ in range(8)]
                # Half a handshake: a valid envelope prefix, then silence.
                assert conns[0].writer is not None
                conns[0].writer.write(b"MXPP\x00\x01")
                await eventually(lambda: listener.handshakes.in_progress == 8)
                per_connection = (tracemalloc.get_traced_memory()[0] - before) // 8
            finally:
                tracemalloc.stop()
            sizes = [s.buffer_bytes for s in listener.handshakes.streams()]
            assert all(0 < n <= HANDSHAKE_BUFFER_BYTES for n in sizes), sizes
            # Everything Python allocated for a connection, at both ends: KiB, not a MiB arena.
            assert per_connection < 64 * 1024, per_connection
            await close_all(conns)
            client = backend_transport(backend, node_id="client")
            channel = await client.connect(*listener.address)
            try:
                await channel.send(MessageKind.CONTROL, {"hi": 1})
                await eventually(lambda: len(accepted) == 1)
                assert accepted[0].buffer_bytes >= CHUNK_BYTES  # only now the big buffers
            finally:
                await channel.close()

    accepted: list[object] = []

    async def grab(channel: object) -> None:
        accepted.append(channel._stream)  # type: ignore[attr-defined]
        await asyncio.sleep(0)

    run(scenario)


def test_a_large_record_commits_memory_only_for_the_bytes_that_arrive() -> None:
    """An unauthenticated length reserves address space, not resident memory: a record
    announcing 128 MiB whose first MiB arrived has cost about a MiB."""
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs /proc to read this process's resident memory")

    def rss() -> int:
        match = re.search(r"VmRSS:\s+(\d+) kB", status.read_text())
        assert match is not None
        return int(match.group(1)) * 1024

    size = 128 * 1024 * 1024
    header = _activation_head((size // 4,))
    first_mib = bytes(1024 * 1024)
    before = rss()
    assembler = MessageAssembler(len(header) + size, FrameLimits())
    fed = _feed(assembler, header) + _feed(assembler, first_mib)
    assert fed == len(header) + len(first_mib) and not assembler.done
    assert rss() - before < 32 * 1024 * 1024  # zeroed memory would be the whole 128 MiB


# -- log forging ---------------------------------------------------------------------------------


def _hello_body(cluster: str, node: str) -> bytes:
    return encode_hello(Hello(0, cluster, node))


def test_a_cluster_name_outside_the_node_id_characters_is_a_bad_hello() -> None:
    for name in ["evil\ncluster", "two words", "caf\u00e9", "tab\there", "a/b"]:
        with pytest.raises(HandshakeError) as error:
            decode_hello(_hello_body(name, "peer"))
        assert error.value.reason is HandshakeFailure.BAD_HELLO
        assert quoted(name) in str(error.value) and "\n" not in str(error.value)
    assert decode_hello(_hello_body("my-cluster_1.0", "peer")).cluster_name == "my-cluster_1.0"


def test_a_wire_config_refuses_names_no_peer_would_accept() -> None:
    with pytest.raises(ConfigurationError, match="cluster name 'two words'"):
        wire_config("two words", "node")
    with pytest.raises(ConfigurationError, match="node id"):
        wire_config("c", "node\n")


def test_a_hello_with_a_newline_in_its_cluster_name_is_refused_and_logged_escaped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forged = "evil\nmlxppd: stage 0 is healthy"

    async def scenario() -> None:
        transport = backend_transport()
        async with await serve(transport) as listener:
            conn = await Silent.open(listener.address)
            assert conn.writer is not None
            # A genuine Noise message 1 (anyone can make one) carrying the forged hello.
            noise = NoiseHandshake(
                initiator=True,
                static=NodeKey.generate(),
                psk=os.urandom(32),
                prologue=prologue(),
            )
            hello = noise.write_message_1(encode_hello(Hello(0, forged, "intruder")))
            conn.writer.write(pack_envelope(HandshakeType.CLIENT_HELLO, hello))
            await until_closed([conn])
            await eventually(lambda: transport.stats.handshake_failures["bad_hello"] == 1)
            await conn.close()
            await assert_serving(listener)

    with caplog.at_level(logging.WARNING, logger="mlxppd.wire"):
        run(scenario)
    lines = [r.getMessage() for r in caplog.records if "bad_hello" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "'evil\\nmlxppd: stage 0 is healthy'" in lines[0] and "\n" not in lines[0]


# -- out of file descriptors -----------------------------------------------------------------------

_EMFILE_CHILD = """
import asyncio, os, resource, sys
from mlxppd.runtime.system import event_loop
from tests.support.wire import backend_transport, echo

async def main():
    transport = backend_transport(sys.argv[1], max_handshakes_per_source=64)
    listener = await transport.listen("127.0.0.1", 0, echo)
    # Room for a few more descriptors only: a flood of connections runs this process out.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
    print(listener.address[1], flush=True)
    await asyncio.sleep(3600)

event_loop.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
@pytest.mark.parametrize(
    ("backend", "loop"), [("tcp", "auto"), ("tcp", "asyncio"), ("rdma", "auto")]
)
def test_a_listener_out_of_file_descriptors_keeps_serving_once_they_are_back(
    backend: str, loop: str
) -> None:
    """Accepting fails with EMFILE while the flood lasts; the listener neither dies nor stops
    listening (uvloop sheds the backlog, asyncio and the rdma accept loop back off)."""

    async def scenario() -> None:
        env = {**os.environ, "MLXPP_EVENT_LOOP": loop}
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _EMFILE_CHILD, backend, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            cwd=REPO_ROOT,
        )  # fmt: skip
        try:
            assert child.stdout is not None
            port = int(await child.stdout.readline())
            # Far more connections than the child has descriptors left: its accept fails.
            flood = [await Silent.open(("127.0.0.1", port)) for _ in range(40)]
            await asyncio.sleep(0.2)
            await close_all(flood)
            assert child.returncode is None
            await _eventually_serving(("127.0.0.1", port))
            assert child.returncode is None
        finally:
            child.kill()
            await child.wait()

    run(scenario)


async def _eventually_serving(address: tuple[str, int]) -> None:
    """A real peer connects and gets an answer, once the listener has room again."""
    client = backend_transport(node_id="good-peer")
    async with asyncio.timeout(30):
        while True:
            try:
                channel = await client.connect(*address)
            except (OSError, TemporaryError, HandshakeError):
                await asyncio.sleep(0.1)
                continue
            try:
                await channel.send(MessageKind.CONTROL, {"ping": 1})
                assert (await channel.recv()).meta == {"ping": 1}
                return
            finally:
                await channel.close()


def _activation_head(shape: tuple[int, ...]) -> bytes:
    """The head of an ACTIVATION message of float32 ``shape`` (its tensor bytes follow)."""
    code = dtype_by_name("float32").code
    fixed = MESSAGE_HEADER.pack(PROTOCOL_VERSION, MessageKind.ACTIVATION, code, len(shape), 8)
    return fixed + struct.pack(f">{len(shape)}Q", *shape) + b" " * 8


def _feed(assembler: MessageAssembler, data: bytes) -> int:
    view, fed = memoryview(data), 0
    while fed < len(data) and not assembler.done:
        window = assembler.window()
        n = min(len(window), len(data) - fed)
        window[:n] = view[fed : fed + n]
        assembler.advance(n)
        fed += n
    return fed
