"""The Transport interface every backend implements, and the connection lifecycle they share.

A transport makes secure channels: ``listen(host, port, handler)`` runs ``handler(channel)``
for every peer it accepts, ``connect(host, port)`` returns a channel to one peer. Backends only
differ in how they open byte streams (and, for ``rdma``, in what they do once the peer's RDMA
version is known); handshake, verdicts, counting and logging are done here, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar

from mlxppd.core.config.roster import Roster
from mlxppd.core.errors import ConfigurationError, TemporaryError
from mlxppd.core.log_text import quoted
from mlxppd.core.log_throttle import LogThrottle
from mlxppd.wire.channel import RekeyPolicy, SecureChannel
from mlxppd.wire.errors import (
    ChannelClosedError,
    FrameError,
    HandshakeError,
    HandshakeFailure,
    PeerAtCapacityError,
)
from mlxppd.wire.handshake import Hello, Verdict, valid_name
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.preauth import HandshakeGate
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.secret import ClusterSecret
from mlxppd.wire.session import HandshakeResult, Identity, client_handshake, server_handshake
from mlxppd.wire.stats import WireStats
from mlxppd.wire.streams import ByteStream
from mlxppd.wire.tasks import TaskSet

__all__ = ["Binding", "Handler", "Listener", "Transport", "WireConfig"]

log = logging.getLogger(__name__)

#: What a listener runs for each accepted channel; the channel is closed when it returns.
Handler = Callable[[SecureChannel], Awaitable[None]]


@dataclass(frozen=True)
class WireConfig:
    """Everything a transport needs to know about this node."""

    cluster_name: str
    node_id: str
    #: the cluster secret: the handshake's pre-shared key (a second factor to the node key)
    secret: ClusterSecret
    #: this node's own long-term key; the roster must list its public half for ``node_id``
    node_key: NodeKey
    #: the node keys this node believes (shared by the node's transports, replaced on reload)
    roster: RosterBook
    limits: FrameLimits = field(default_factory=FrameLimits)
    #: when a channel replaces its keys (records sealed, seconds)
    rekey: RekeyPolicy = field(default_factory=RekeyPolicy)
    #: seconds a peer has to complete the handshake, or it is dropped (slow-loris guard)
    handshake_timeout_s: float = 10.0
    #: accepted channels a listener holds at once; more get an authenticated "at capacity"
    max_connections: int = 64
    #: connections a listener lets handshake at once; more are closed before being read
    max_handshakes: int = 64
    #: connections from one source address a listener lets handshake at once; more are closed
    max_handshakes_per_source: int = 8

    def __post_init__(self) -> None:
        # Both names travel in every hello, where the peer refuses anything outside these
        # characters: say so at start rather than fail every handshake later.
        for what, key, value in (
            ("cluster name", "cluster.name", self.cluster_name),
            ("node id", "node_id", self.node_id),
        ):
            if not valid_name(value):
                raise ConfigurationError(
                    f"the {what} {quoted(value)} may only hold letters, digits, '.', "
                    f"'_' and '-' (at most 255 bytes); rename it",
                    key=key,
                )
        if self.max_handshakes < 1 or self.max_handshakes_per_source < 1:
            raise ValueError("max_handshakes and max_handshakes_per_source must be at least 1")


@dataclass(frozen=True)
class Binding:
    """A backend's listening socket: its address and how to stop it."""

    address: tuple[str, int]
    stop_accepting: Callable[[], None]
    wait_stopped: Callable[[], Awaitable[None]]


class Listener:
    """A listening socket and the connections it accepted; ``close()`` ends them all."""

    def __init__(self, transport: Transport, handler: Handler):
        self._transport = transport
        self._handler = handler
        self._tasks = TaskSet()
        self._binding: Binding | None = None
        #: accepted channels (including ones whose verdict is on its way)
        self.active = 0
        config = transport.config
        #: the connections still handshaking, and the caps on them
        self.handshakes = HandshakeGate(config.max_handshakes, config.max_handshakes_per_source)

    @property
    def address(self) -> tuple[str, int]:
        """The bound ``(host, port)``; the port is the real one when 0 was asked for."""
        assert self._binding is not None
        return self._binding.address

    def _spawn(self, stream: ByteStream) -> None:
        # Runs as the connection is accepted, before anything is read from it.
        refusal = self.handshakes.admit(stream)
        if refusal is not None:
            stream.close()
            self._transport.stats.preauth_refused[refusal] += 1
            self.handshakes.note_refusal(refusal, stream)
            return
        task = self._tasks.spawn(
            self._transport._serve_connection(self, stream), name=f"wire-conn-{stream.peer}"
        )
        # A task cancelled before it ran never reaches its own release.
        task.add_done_callback(lambda _: self.handshakes.release(stream))

    def _decide(self, peer: Hello) -> tuple[Verdict, str]:
        # Membership was settled by the handshake (the roster); only capacity is left.
        config = self._transport.config
        if self.active >= config.max_connections:
            return Verdict.AT_CAPACITY, f"{self.active} of {config.max_connections} connections"
        self.active += 1  # reserved now, so concurrent handshakes cannot overshoot
        return Verdict.ACCEPTED, ""

    async def close(self) -> None:
        """Stop accepting, close every connection, and wait for all of it."""
        if self._binding is not None:
            self._binding.stop_accepting()
        await self._tasks.close()
        if self._binding is not None:
            await self._binding.wait_stopped()

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Transport(ABC):
    """Makes secure channels to and from peers; one instance per node and backend."""

    #: the ``transport_backend`` value this class implements
    backend: ClassVar[str]

    def __init__(self, config: WireConfig, *, stats: WireStats | None = None):
        self.config = config
        self.stats = stats if stats is not None else WireStats()
        self._failures_log = LogThrottle()
        self._channels: weakref.WeakSet[SecureChannel] = weakref.WeakSet()
        config.roster.watch(self)

    def roster_changed(self, roster: Roster) -> None:
        """Close the open channels whose peer the new roster no longer lists with its key."""
        for channel in list(self._channels):
            if channel.closed or roster.holds(channel.peer_node_id, channel.peer_key):
                continue
            self.stats.revoked_channels += 1
            log.warning(
                "wire: closing the channel to node %s at %s: its key is no longer in the roster",
                quoted(channel.peer_node_id),
                channel.peer_address,
            )
            channel.revoke()

    # -- what backends provide ----------------------------------------------------------------

    @abstractmethod
    async def _bind(self, host: str, port: int, on_stream: Callable[[ByteStream], None]) -> Binding:
        """Listen on ``host:port`` and call ``on_stream`` for every accepted connection."""

    @abstractmethod
    async def _open(self, host: str, port: int) -> ByteStream:
        """A connected stream to ``host:port``."""

    def _rdma_version(self) -> int:
        """The RDMA protocol version this node advertises (0: not RDMA-aware)."""
        return 0

    async def _after_handshake(self, stream: ByteStream, peer: Hello) -> ByteStream:
        """The stream the channel will use, once the peer is authenticated and accepted."""
        return stream

    # -- the interface ------------------------------------------------------------------------

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        """Accept peers on ``host:port`` (port 0: any free port, see ``Listener.address``)."""
        listener = Listener(self, handler)
        listener._binding = await self._bind(host, port, listener._spawn)
        return listener

    async def connect(
        self, host: str, port: int, *, expected_peer: str | None = None
    ) -> SecureChannel:
        """A channel to the node listening on ``host:port`` (``expected_peer``: its node id)."""
        try:
            async with asyncio.timeout(self.config.handshake_timeout_s):
                stream = await self._open(host, port)
        except (OSError, TimeoutError) as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or exc
            raise TemporaryError(
                f"cannot connect to {host}:{port}: {why}; is the peer running?"
            ) from None
        try:
            async with asyncio.timeout(self.config.handshake_timeout_s):
                result = await client_handshake(
                    stream, self._identity(), expected_peer=expected_peer
                )
        except PeerAtCapacityError as exc:
            log.info("wire: %s", exc)
            await _close(stream)
            raise
        except BaseException as exc:
            error = self._handshake_failed(exc, stream.peer)
            await _close(stream)
            if error is None:
                raise
            raise error from None
        try:
            return await self._establish(stream, result)
        except BaseException:
            await _close(stream)
            raise

    # -- shared lifecycle ---------------------------------------------------------------------

    def _identity(self) -> Identity:
        c = self.config
        return Identity(
            c.cluster_name,
            c.node_id,
            c.secret,
            c.node_key,
            c.roster.current,
            c.limits,
            self._rdma_version(),
        )

    async def _establish(self, stream: ByteStream, result: HandshakeResult) -> SecureChannel:
        stream = await self._after_handshake(stream, result.peer)
        stream.open_buffers()  # the peer is authenticated and accepted: full-size buffers now
        self.stats.channels_established += 1
        channel = SecureChannel(
            stream,
            result.sealer,
            result.opener,
            limits=self.config.limits,
            stats=self.stats,
            local_node_id=self.config.node_id,
            peer_node_id=result.peer.node_id,
            peer_rdma_version=result.peer.rdma_version,
            peer_key=result.peer_key,
            rekey=self.config.rekey,
        )
        self._channels.add(channel)
        # The handshake checked the roster of its start; one replaced since was not applied to
        # this channel yet (it was in no list), so apply the current one now.
        current = self.config.roster.current
        if not current.holds(channel.peer_node_id, channel.peer_key):
            self.roster_changed(current)
        return channel

    def _handshake_failed(
        self, exc: BaseException, peer: str, *, accepted: bool = False
    ) -> HandshakeError | None:
        """Count and log a failed handshake once; the error to raise (None: re-raise ``exc``).

        ``accepted``: the peer connected to us; anyone can cause that at will, so those lines
        are throttled (the counts of the ones not logged ride on the next line)."""
        if isinstance(exc, TimeoutError):
            error = HandshakeError(
                HandshakeFailure.TIMEOUT,
                f"peer {peer} did not finish the handshake in {self.config.handshake_timeout_s} s",
            )
        elif isinstance(exc, HandshakeError):
            error = exc
        elif isinstance(exc, ConnectionError | OSError):
            error = HandshakeError(
                HandshakeFailure.CLOSED, f"connection to {peer} lost during the handshake: {exc}"
            )
        else:
            return None  # cancellation or a bug: not a peer's doing
        self.stats.handshake_failures[error.reason] += 1
        if error.frame_error is not None:
            self.stats.rejected_frames[error.frame_error.reason] += 1
        if not accepted:
            log.warning("wire: handshake with %s failed (%s): %s", peer, error.reason, error)
        elif (counts := self._failures_log.note(error.reason)) is not None:
            log.warning(
                "wire: handshakes from peers failed (%s); the latest, from %s: %s",
                counts, peer, error,
            )  # fmt: skip
        return error

    async def _serve_connection(self, listener: Listener, stream: ByteStream) -> None:
        reserved = False

        def decide(peer: Hello) -> tuple[Verdict, str]:
            nonlocal reserved
            verdict, reason = listener._decide(peer)
            reserved = verdict is Verdict.ACCEPTED
            return verdict, reason

        try:
            try:
                async with asyncio.timeout(self.config.handshake_timeout_s):
                    result = await server_handshake(stream, self._identity(), decide)
            except BaseException as exc:
                if self._handshake_failed(exc, stream.peer, accepted=True) is None:
                    raise
                return
            finally:
                listener.handshakes.release(stream)
            self.stats.verdicts_sent[result.verdict.name.lower()] += 1
            if result.verdict is not Verdict.ACCEPTED:
                log.info("wire: told %s: %s (%s)", stream.peer, result.verdict.name, result.reason)
                return
            channel = await self._establish(stream, result)
            try:
                await listener._handler(channel)
            except (FrameError, ChannelClosedError):
                pass  # counted and logged by the channel, which closed the connection
            except Exception:
                log.exception("wire: the handler for %r failed", channel)
            finally:
                await channel.close()
        finally:
            if reserved:
                listener.active -= 1
            await _close(stream)


async def _close(stream: ByteStream) -> None:
    stream.close()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await stream.wait_closed()
