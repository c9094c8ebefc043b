"""The ``rdma`` backend. Plainly: it is not RDMA. There are no verbs, no InfiniBand or RoCE,
and no memory registered with a NIC; every byte still crosses the kernel's TCP stack. What it
adds over ``tcp`` is a leaner socket path on hosts whose probe passes (Linux with io_uring).

At bind (or first connect) it probes the host (``rdma_probe``). When the probe succeeds, its
connections use ``SocketByteStream``: preallocated ("registered") send and receive arenas,
``sendmsg`` scatter-gather and ``recv_into``, and large records encrypted straight from tensor
memory into the arena. When it fails, the backend is plain ``tcp`` and says so once per process:

    rdma_transport: falling back to TCP (reason=os=..., driver=...: ...)

Each peer advertises its RDMA protocol version in its (authenticated) hello. A peer that
advertises 0 or another version makes that one connection fall back to the tcp stream:

    rdma_transport: peer negotiation fallback (peer=host:port, reason=...)

Python does not drive io_uring itself: the probe only decides whether the host gets the
arena-based socket path. The name keeps the cluster TOML's ``transport_backend = "rdma"``
meaning "the fastest transport this host offers"; a real RDMA path would live here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from mlxppd.wire.handshake import Hello
from mlxppd.wire.protocol_stream import ProtocolByteStream
from mlxppd.wire.rdma_probe import ProbeResult, probe_acceleration
from mlxppd.wire.socket_stream import SocketByteStream
from mlxppd.wire.stats import WireStats
from mlxppd.wire.streams import CHUNK_BYTES, ByteStream
from mlxppd.wire.tasks import spawn, stop_tasks
from mlxppd.wire.tcp import TcpTransport
from mlxppd.wire.transport import Binding, WireConfig
from mlxppd.wire.version import RDMA_PROTOCOL_VERSION

__all__ = [
    "PROCESS_FALLBACK_LOG",
    "FallbackLog",
    "RdmaState",
    "RdmaTransport",
    "negotiate_rdma",
]

log = logging.getLogger(__name__)

#: Seconds the accept loop waits after a failed accept, and between two log lines about it.
_ACCEPT_RETRY_S = 0.1
_ACCEPT_LOG_INTERVAL_S = 10.0


class FallbackLog:
    """Emits the host-level fallback line at most once (one instance per process by default)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reported = False

    def report(self, reason: str) -> bool:
        """Log the line unless it was already logged; True when this call logged it."""
        with self._lock:
            if self._reported:
                return False
            self._reported = True
        log.warning("rdma_transport: falling back to TCP (reason=%s)", reason)
        return True


#: The process-wide instance every RdmaTransport reports to unless given its own.
PROCESS_FALLBACK_LOG = FallbackLog()


def negotiate_rdma(local_version: int, peer_version: int, os_name: str) -> str | None:
    """None when both ends run the same RDMA protocol, else the per-peer fallback reason."""
    if peer_version == local_version:
        return None
    if peer_version == 0:
        return f"os={os_name}, peer_version=0: peer is not RDMA-aware"
    return (
        f"os={os_name}, peer_version={peer_version}: incompatible with local RDMA protocol "
        f"version {local_version}"
    )


@dataclass(frozen=True)
class RdmaState:
    """The negotiation state, for the metrics collector."""

    acceleration: str  # the primitive in use ("io_uring", "kqueue") or "none"
    fallback_reason: str | None
    peers_negotiated: int
    peer_fallbacks: int


class RdmaTransport(TcpTransport):
    """TCP with the fast socket path when the host and the peer allow it."""

    backend = "rdma"

    def __init__(
        self,
        config: WireConfig,
        *,
        stats: WireStats | None = None,
        probe: Callable[[], ProbeResult] = probe_acceleration,
        fallback_log: FallbackLog = PROCESS_FALLBACK_LOG,
        arena_bytes: int = CHUNK_BYTES,
    ):
        super().__init__(config, stats=stats)
        self._probe = probe
        self._fallback_log = fallback_log
        self._arena_bytes = arena_bytes
        self._result: ProbeResult | None = None
        self._peers_negotiated = 0
        self._peer_fallbacks = 0
        self._logged_peers: set[tuple[str, str]] = set()

    # -- state --------------------------------------------------------------------------------

    def probe(self) -> ProbeResult:
        """Probe the host once; a failure logs the fallback line (once per process)."""
        if self._result is None:
            self._result = self._probe()
            if not self._result.accelerated:
                self._fallback_log.report(self._result.reason)
        return self._result

    @property
    def accelerated(self) -> bool:
        return self.probe().accelerated

    @property
    def state(self) -> RdmaState:
        result = self.probe()
        return RdmaState(
            acceleration=result.driver if result.accelerated else "none",
            fallback_reason=None if result.accelerated else result.reason,
            peers_negotiated=self._peers_negotiated,
            peer_fallbacks=self._peer_fallbacks,
        )

    # -- backend hooks ------------------------------------------------------------------------

    def _rdma_version(self) -> int:
        return RDMA_PROTOCOL_VERSION if self.accelerated else 0

    async def _bind(self, host: str, port: int, on_stream: Callable[[ByteStream], None]) -> Binding:
        if not self.accelerated:
            return await super()._bind(host, port, on_stream)
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        bound = sock.getsockname()
        task = spawn(self._accept_loop(sock, on_stream), name=f"wire-accept-{bound[0]}:{bound[1]}")

        async def wait_stopped() -> None:
            await stop_tasks(task, cancel=False, ignore_errors=True)
            sock.close()

        def stop_accepting() -> None:
            task.cancel()

        return Binding((bound[0], bound[1]), stop_accepting, wait_stopped)

    async def _accept_loop(
        self, sock: socket.socket, on_stream: Callable[[ByteStream], None]
    ) -> None:
        loop = asyncio.get_running_loop()
        failures, next_log = 0, 0.0
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                # E.g. out of file descriptors (EMFILE): back off instead of spinning on a
                # listening socket that stays readable, keep serving, log once in a while.
                failures += 1
                if loop.time() >= next_log:
                    log.warning("wire: accept failed (%d times): %s", failures, exc)
                    failures, next_log = 0, loop.time() + _ACCEPT_LOG_INTERVAL_S
                await asyncio.sleep(_ACCEPT_RETRY_S)
                continue
            try:
                stream = SocketByteStream(conn, arena_bytes=self._arena_bytes)
            except OSError:  # the peer left before we looked at it
                conn.close()
                continue
            on_stream(stream)

    async def _open(self, host: str, port: int) -> ByteStream:
        if not self.accelerated:
            return await super()._open(host, port)
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        error: OSError = OSError(f"no address for {host}")
        for family, type_, proto, _, addr in infos:
            sock = socket.socket(family, type_, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, addr)
                return SocketByteStream(sock, arena_bytes=self._arena_bytes)
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:  # cancelled (a timeout): do not leak the socket
                sock.close()
                raise
        raise error

    async def _after_handshake(self, stream: ByteStream, peer: Hello) -> ByteStream:
        if not isinstance(stream, SocketByteStream):
            return stream  # the host fell back: everything is plain tcp already
        reason = negotiate_rdma(RDMA_PROTOCOL_VERSION, peer.rdma_version, self.probe().os)
        if reason is None:
            self._peers_negotiated += 1
            stream.enable_readahead()
            return stream
        self._peer_fallbacks += 1
        if (peer.node_id, reason) not in self._logged_peers:
            self._logged_peers.add((peer.node_id, reason))
            log.warning(
                "rdma_transport: peer negotiation fallback (peer=%s, reason=%s)",
                stream.peer,
                reason,
            )
        sock = stream.detach()
        try:
            return await ProtocolByteStream.from_socket(sock)
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
