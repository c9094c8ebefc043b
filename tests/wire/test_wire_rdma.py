"""The RDMA-aware backend: the host probe, its once-per-process fallback line, peer negotiation."""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mlxppd.wire.backends import create_transport
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.rdma import FallbackLog, RdmaTransport, negotiate_rdma
from mlxppd.wire.rdma_probe import (
    IO_URING_DISABLED_PATH,
    ProbeResult,
    call_io_uring_setup,
    probe_acceleration,
    probe_linux,
    probe_macos,
)
from mlxppd.wire.streams import advance_buffers
from mlxppd.wire.version import RDMA_PROTOCOL_VERSION
from tests.support.paths import REPO_ROOT
from tests.support.wire import ACCELERATED, config, run, serve

pytestmark = pytest.mark.timeout(60)

NO_IO_URING = ProbeResult(
    "linux", "io_uring_missing", "kernel does not export io_uring_setup (ENOSYS)", False
)
FALLBACK_LINE = (
    "rdma_transport: falling back to TCP (reason=os=linux, driver=io_uring_missing: "
    "kernel does not export io_uring_setup (ENOSYS))"
)


# -- the probe ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("knob", "errno_", "machine", "reason"),
    [
        ("0\n", 0, "x86_64", None),
        (None, 0, "aarch64", None),
        (
            "2\n",
            0,
            "x86_64",
            "os=linux, driver=io_uring_disabled: kernel.io_uring_disabled=2 "
            "disables io_uring for all",
        ),
        (
            None,
            errno.ENOSYS,
            "x86_64",
            "os=linux, driver=io_uring_missing: kernel does not export io_uring_setup (ENOSYS)",
        ),
        (
            "1\n",
            errno.EPERM,
            "x86_64",
            "os=linux, driver=io_uring_denied: io_uring_setup refused "
            "(EPERM): kernel.io_uring_disabled=1 limits it to kernel.io_uring_group",
        ),
        (
            "0\n",
            errno.EPERM,
            "x86_64",
            "os=linux, driver=io_uring_denied: io_uring_setup refused "
            "(EPERM): blocked by seccomp or a security module",
        ),
        (
            "0\n",
            errno.ENOMEM,
            "x86_64",
            "os=linux, driver=io_uring_unavailable: io_uring_setup failed (ENOMEM)",
        ),
        (
            None,
            0,
            "mips64",
            "os=linux, driver=unsupported: no io_uring_setup syscall number is known for mips64",
        ),
    ],
    ids=[
        "enabled",
        "pre-6.6 kernel",
        "knob 2",
        "ENOSYS",
        "knob 1 + EPERM",
        "seccomp",
        "ENOMEM",
        "other syscall table",
    ],
)
def test_the_linux_probe_reads_the_knob_then_asks_the_kernel(
    knob: str | None, errno_: int, machine: str, reason: str | None
) -> None:
    result = probe_linux(lambda: knob, lambda: errno_, machine)
    assert result.accelerated is (reason is None)
    if reason is not None:
        assert result.reason == reason


def test_the_probe_on_other_systems() -> None:
    assert probe_macos(True).accelerated and probe_macos(True).driver == "kqueue"
    assert (
        probe_macos(False).reason
        == "os=macos, driver=kqueue_missing: select.kqueue is not available"
    )
    other = probe_acceleration("win32")
    assert not other.accelerated
    assert other.reason == "os=win32, driver=unsupported: no zero-copy primitive on this platform"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="probes this Linux host")
def test_the_probe_reports_this_machine_truthfully() -> None:
    result = probe_acceleration()
    try:
        knob: str | None = open(IO_URING_DISABLED_PATH).read().strip()
    except OSError:
        knob = None
    if knob == "2":
        expected = "io_uring_disabled"
    else:
        err = call_io_uring_setup()
        expected = {0: "io_uring", errno.ENOSYS: "io_uring_missing"}.get(
            err, "io_uring_denied" if err in (errno.EPERM, errno.EACCES) else "io_uring_unavailable"
        )
    assert result.driver == expected, result.reason
    assert re.fullmatch(r"os=linux, driver=\w+: .+", result.reason)
    print(f"\nthis machine: accelerated={result.accelerated} ({result.reason})")


# -- the host-level fallback line --------------------------------------------------------------


def test_a_failed_probe_falls_back_to_tcp_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="mlxppd.wire")
    once = FallbackLog()

    async def scenario() -> None:
        server = RdmaTransport(config("server"), probe=lambda: NO_IO_URING, fallback_log=once)
        client = RdmaTransport(config("client"), probe=lambda: NO_IO_URING, fallback_log=once)
        async with await serve(server) as listener:
            channel = await client.connect(*listener.address)
            await channel.send(MessageKind.CONTROL, {"still": "works"})
            assert (await channel.recv()).meta == {"still": "works"}
            await channel.close()
        for transport in (server, client):
            state = transport.state
            assert state.acceleration == "none"
            assert state.fallback_reason == NO_IO_URING.reason
            assert (state.peers_negotiated, state.peer_fallbacks) == (0, 0)

    run(scenario)
    lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert lines == [FALLBACK_LINE]


def test_the_fallback_line_is_logged_once_per_process() -> None:
    """Two transports, two listens, one real process: one line on its log."""
    script = textwrap.dedent(
        """
        import asyncio, logging
        from mlxppd.wire.rdma import RdmaTransport
        from mlxppd.wire.rdma_probe import ProbeResult
        from tests.support.wire import config, echo

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        failed = ProbeResult("linux", "io_uring_missing",
                             "kernel does not export io_uring_setup (ENOSYS)", False)

        async def main():
            for name in ("a", "b"):
                transport = RdmaTransport(config(name), probe=lambda: failed)
                listener = await transport.listen("127.0.0.1", 0, echo)
                await listener.close()

        asyncio.run(main())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=REPO_ROOT,  # so `tests.support.wire` imports
    )
    assert [line for line in out.stderr.splitlines() if "rdma_transport" in line] == [FALLBACK_LINE]


# -- peer negotiation --------------------------------------------------------------------------


def test_negotiation_reasons_name_the_peer_version() -> None:
    assert negotiate_rdma(1, 1, "linux") is None
    assert negotiate_rdma(1, 0, "linux") == "os=linux, peer_version=0: peer is not RDMA-aware"
    assert negotiate_rdma(1, 99, "linux") == (
        "os=linux, peer_version=99: incompatible with local RDMA protocol version 1"
    )


class FutureRdma(RdmaTransport):
    """A peer that speaks RDMA protocol version 99."""

    def _rdma_version(self) -> int:
        return 99


@pytest.mark.parametrize(
    ("peer", "peer_version"), [("tcp", 0), ("future", 99)], ids=["not RDMA-aware", "mismatched"]
)
def test_a_peer_without_our_rdma_version_falls_back_per_peer_and_still_works(
    peer: str, peer_version: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mlxppd.wire")
    payload = np.arange(300_000, dtype=np.float32)  # large enough for the streamed path

    async def scenario() -> None:
        server = RdmaTransport(config("server"), probe=lambda: ACCELERATED)
        async with await serve(server) as listener:
            for _ in range(2):  # a reconnect from the same peer is not logged again
                if peer == "tcp":
                    client = create_transport("tcp", config("old-peer"))
                else:
                    client = FutureRdma(config("old-peer"), probe=lambda: ACCELERATED)
                channel = await client.connect(*listener.address)
                await channel.send(MessageKind.ACTIVATION, {"n": 1}, payload)
                reply = await channel.recv()
                assert reply.tensor is not None
                assert np.array_equal(np.frombuffer(reply.tensor.data, np.float32), payload)
                await channel.close()
        state = server.state
        assert state.acceleration == "io_uring" and state.fallback_reason is None
        assert (state.peers_negotiated, state.peer_fallbacks) == (0, 2)

    run(scenario)
    lines = [r.getMessage() for r in caplog.records if "peer negotiation" in r.getMessage()]
    expected = negotiate_rdma(RDMA_PROTOCOL_VERSION, peer_version, "linux")
    assert len(lines) == 1
    assert re.fullmatch(
        r"rdma_transport: peer negotiation fallback \(peer=127\.0\.0\.1:\d+, reason="
        + re.escape(str(expected))
        + r"\)",
        lines[0],
    )


def test_two_rdma_peers_negotiate_the_fast_path() -> None:
    payload = np.arange(3_000_000, dtype=np.uint8)

    async def scenario() -> None:
        server = RdmaTransport(config("server"), probe=lambda: ACCELERATED)
        client = RdmaTransport(config("client"), probe=lambda: ACCELERATED)
        async with await serve(server) as listener:
            channel = await client.connect(*listener.address)
            assert channel.peer_rdma_version == RDMA_PROTOCOL_VERSION
            for _ in range(3):
                await channel.send(MessageKind.ACTIVATION, {}, payload)
                reply = await channel.recv()
                assert reply.tensor is not None and bytes(reply.tensor.data) == payload.tobytes()
            await channel.close()
        for transport in (server, client):
            assert transport.state.peers_negotiated == 1
            assert transport.state.peer_fallbacks == 0

    run(scenario)


def test_the_fast_path_survives_a_tiny_arena_under_back_pressure() -> None:
    """Records far larger than the preallocated buffers, interleaved with small ones."""
    big = np.arange(1 << 20, dtype=np.uint8)

    async def scenario() -> None:
        server = RdmaTransport(config("server"), probe=lambda: ACCELERATED, arena_bytes=4096)
        client = RdmaTransport(config("client"), probe=lambda: ACCELERATED, arena_bytes=4096)
        async with await serve(server) as listener:
            channel = await client.connect(*listener.address)
            sends = [
                channel.send(MessageKind.ACTIVATION, {"i": i}, big if i % 2 else big[:100])
                for i in range(6)
            ]
            await asyncio.gather(*sends)
            for i in range(6):
                reply = await channel.recv()
                assert reply.meta == {"i": i} and reply.tensor is not None
                assert bytes(reply.tensor.data) == (big if i % 2 else big[:100]).tobytes()
            await channel.close()
        assert server.state.peers_negotiated == 1
        assert not server.stats.rejected_frames and not client.stats.rejected_frames

    run(scenario)


def test_a_partial_scatter_gather_send_resumes_where_the_kernel_stopped() -> None:
    parts = [memoryview(b"head"), memoryview(b"ciphertext"), memoryview(b"tag")]
    assert [bytes(p) for p in advance_buffers(parts, 0)] == [b"head", b"ciphertext", b"tag"]
    assert [bytes(p) for p in advance_buffers(parts, 6)] == [b"phertext", b"tag"]
    assert [bytes(p) for p in advance_buffers(parts, 14)] == [b"tag"]
    assert advance_buffers(parts, 17) == []
