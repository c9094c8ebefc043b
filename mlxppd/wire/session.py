"""Running the handshake over a byte stream, for either role (protocol 2: Noise XXpsk3).

    client                                   server
    CLIENT_HELLO  (-> e)  ------------------>
                  <------------------  SERVER_HELLO (<- e, ee, s, es)
    CLIENT_PROOF  (-> s, se, psk) ---------->   (or CLIENT_ABORT)
                  <------------------  record 0: VERDICT (AES-GCM, server-to-client key)

A version mismatch is answered with VERSION_REFUSED before anything else. The client refuses a
server of another cluster, one whose static key is not the roster's key for the node id it
claims, and (when it meant to reach a given node) any other node. The server refuses a client
whose last message fails authentication (another cluster secret) and one whose static key is
not the roster's for its id, the same way for both: it closes without a verdict, so a probe
learns nothing about which factor it lacks. Errors are raised, never logged or counted here:
the transport does that once per connection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxppd.core.config.roster import ROSTER_KEY, Roster, public_key_text
from mlxppd.core.log_text import quoted
from mlxppd.wire.channel import read_small_record
from mlxppd.wire.errors import (
    ChannelClosedError,
    FrameError,
    FrameRejectReason,
    HandshakeError,
    HandshakeFailure,
    PeerAtCapacityError,
    VersionMismatchError,
)
from mlxppd.wire.handshake import (
    ENVELOPE,
    AbortReason,
    HandshakeType,
    Hello,
    Verdict,
    decode_abort,
    decode_hello,
    decode_verdict,
    encode_hello,
    encode_verdict,
    pack_envelope,
    parse_envelope,
    prologue,
    psk_from_secret,
)
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.noise import Ephemeral, NoiseError, NoiseHandshake
from mlxppd.wire.record import RecordOpener, RecordSealer, RecordType
from mlxppd.wire.secret import ClusterSecret
from mlxppd.wire.streams import ByteStream, StreamEOF
from mlxppd.wire.version import PROTOCOL_VERSION

__all__ = ["HandshakeResult", "Identity", "client_handshake", "server_handshake"]

#: Decides the verdict for an authenticated peer: (verdict, reason shown to the peer).
Decide = Callable[[Hello], tuple[Verdict, str]]


@dataclass(frozen=True)
class Identity:
    """Who this node is, what it proves that with, and whom it believes."""

    cluster_name: str
    node_id: str
    secret: ClusterSecret
    node_key: NodeKey
    #: the node keys this node believes, as of this handshake
    roster: Roster
    limits: FrameLimits
    rdma_version: int = 0
    #: a test's known ephemeral key (None: a fresh random one per handshake)
    ephemeral: Ephemeral | None = field(default=None, repr=False)

    def noise(self, *, initiator: bool) -> NoiseHandshake:
        extra = {} if self.ephemeral is None else {"ephemeral": self.ephemeral}
        return NoiseHandshake(
            initiator=initiator,
            static=self.node_key,
            psk=psk_from_secret(self.secret.key_bytes()),
            prologue=prologue(),
            **extra,
        )


@dataclass
class HandshakeResult:
    """An accepted connection: the peer's hello, its proven key and this side's records."""

    peer: Hello
    sealer: RecordSealer
    opener: RecordOpener
    verdict: Verdict = Verdict.ACCEPTED
    reason: str = ""
    #: the static key the peer proved it holds (the roster's key for ``peer.node_id``)
    peer_key: bytes = b""


async def _read(stream: ByteStream, n: int) -> bytes:
    try:
        return bytes(await stream.read_exactly(n))
    except StreamEOF:
        raise HandshakeError(
            HandshakeFailure.CLOSED,
            f"peer {stream.peer} closed the connection during the handshake",
        ) from None


async def _read_envelope(stream: ByteStream, *expected: HandshakeType) -> tuple[int, bytes, bytes]:
    """(type, whole message bytes, body) of the next handshake message."""
    prefix = await _read(stream, ENVELOPE.size)
    env = parse_envelope(prefix)
    if env.version != PROTOCOL_VERSION:
        raise VersionMismatchError(PROTOCOL_VERSION, env.version, stream.peer)
    body = await _read(stream, env.body_len)
    if env.type not in expected:
        raise HandshakeError(
            HandshakeFailure.BAD_HELLO,
            f"peer {stream.peer} sent handshake message type {env.type} out of turn",
        )
    return env.type, prefix + body, body


def _who(stream: ByteStream, hello: Hello) -> str:
    # The peer's own words (node id, cluster name, verdict reason) are escaped: log lines.
    return f"peer {stream.peer} (node {quoted(hello.node_id)})"


def _mismatch(who: str, peer: Hello, me: Identity) -> str:
    theirs, ours = quoted(peer.cluster_name), quoted(me.cluster_name)
    return f"{who} belongs to cluster {theirs}, this node to {ours}"


def _refused_proof(who: str, me: Identity) -> HandshakeError:
    # One sentence for both causes (secret, node key): a prober must not tell them apart.
    return HandshakeError(
        HandshakeFailure.BAD_PROOF,
        f"{who} failed authentication: it holds another cluster secret than this node's "
        f"(from {me.secret.origin}) or a node key that {ROSTER_KEY} does not list for its id",
    )


async def client_handshake(
    stream: ByteStream, me: Identity, *, expected_peer: str | None = None
) -> HandshakeResult:
    """Authenticate to a server and read its verdict; raises unless accepted."""
    noise = me.noise(initiator=True)
    hello = encode_hello(Hello(me.rdma_version, me.cluster_name, me.node_id))
    await stream.write((pack_envelope(HandshakeType.CLIENT_HELLO, noise.write_message_1(hello)),))
    _, _, body = await _read_envelope(stream, HandshakeType.SERVER_HELLO)
    try:
        peer = decode_hello(noise.read_message_2(body))
    except NoiseError as exc:
        raise HandshakeError(
            HandshakeFailure.BAD_HELLO, f"peer {stream.peer} sent a hello that failed checks: {exc}"
        ) from None
    who = _who(stream, peer)

    async def abort(reason: AbortReason, failure: HandshakeFailure, message: str) -> None:
        # Telling the server why is a courtesy; the refusal stands even if it cannot be sent.
        with contextlib.suppress(OSError):
            await stream.write((pack_envelope(HandshakeType.CLIENT_ABORT, bytes([reason])),))
        raise HandshakeError(failure, message)

    if peer.cluster_name != me.cluster_name:
        await abort(
            AbortReason.CLUSTER_MISMATCH,
            HandshakeFailure.CLUSTER_MISMATCH,
            _mismatch(who, peer, me),
        )
    if expected_peer is not None and peer.node_id != expected_peer:
        await abort(
            AbortReason.UNEXPECTED_PEER,
            HandshakeFailure.UNEXPECTED_PEER,
            f"{who} answered, but this node meant to reach node {quoted(expected_peer)}",
        )
    listed = me.roster.key_of(peer.node_id)
    if not me.roster.holds(peer.node_id, noise.remote_static):
        shown = public_key_text(noise.remote_static)
        await abort(
            AbortReason.BAD_SERVER_PROOF,
            HandshakeFailure.WRONG_NODE_KEY,
            f"{who} proved the node key {shown}, but {ROSTER_KEY} "
            + (
                f"lists {public_key_text(listed)} for that id"
                if listed is not None
                else "does not list that id"
            )
            + "; it is not the node it claims to be, or this node's roster is out of date",
        )
    await stream.write((pack_envelope(HandshakeType.CLIENT_PROOF, noise.write_message_3(b"")),))
    to_server, to_client = noise.split()
    sealer = RecordSealer(to_server)
    opener = RecordOpener(to_client)
    try:
        rtype, plain = await read_small_record(stream, opener, me.limits)
        if rtype is not RecordType.VERDICT:
            raise FrameError(
                FrameRejectReason.UNEXPECTED_RECORD, f"{rtype.name} instead of a verdict"
            )
        verdict, reason = decode_verdict(plain)
    except FrameError as exc:
        raise HandshakeError(
            HandshakeFailure.BAD_VERDICT,
            f"{who} sent a verdict that failed checks ({exc}): it does not hold this node's "
            f"cluster secret (from {me.secret.origin}), or the link altered it",
            frame_error=exc,
        ) from None
    except ChannelClosedError:
        raise HandshakeError(
            HandshakeFailure.PEER_REJECTED_PROOF,
            f"{who} closed the connection instead of answering this node's proof: the two hold "
            f"different cluster secrets, or its {ROSTER_KEY} does not list this node's key "
            f"({me.node_key.public_text}) for {quoted(me.node_id)}",
        ) from None
    if verdict is Verdict.AT_CAPACITY:
        raise PeerAtCapacityError(f"{who} is at capacity ({quoted(reason)}); retry later")
    if verdict is Verdict.REFUSED:
        raise HandshakeError(HandshakeFailure.REFUSED, f"{who} refused this node: {quoted(reason)}")
    return HandshakeResult(peer, sealer, opener, peer_key=noise.remote_static)


async def server_handshake(stream: ByteStream, me: Identity, decide: Decide) -> HandshakeResult:
    """Authenticate a client and send it a verdict.

    Returns for every authenticated client, whatever the verdict (the caller closes a refused
    one); raises ``HandshakeError`` when the client could not be authenticated.
    """
    try:
        _, _, body = await _read_envelope(stream, HandshakeType.CLIENT_HELLO)
    except VersionMismatchError:
        # Answer with our version so the other side can name it too, then give up.
        with contextlib.suppress(OSError):
            await stream.write((pack_envelope(HandshakeType.VERSION_REFUSED),))
        raise
    noise = me.noise(initiator=False)
    hello = encode_hello(Hello(me.rdma_version, me.cluster_name, me.node_id))
    try:
        peer = decode_hello(noise.read_message_1(body))
        # Its first DH refuses a degenerate ephemeral key, which message 1 can carry unsigned.
        reply = noise.write_message_2(hello)
    except NoiseError:
        raise HandshakeError(HandshakeFailure.BAD_HELLO, "malformed hello from the peer") from None
    await stream.write((pack_envelope(HandshakeType.SERVER_HELLO, reply),))
    who = _who(stream, peer)
    if peer.cluster_name != me.cluster_name:
        raise HandshakeError(HandshakeFailure.CLUSTER_MISMATCH, _mismatch(who, peer, me))
    htype, _, answer = await _read_envelope(
        stream, HandshakeType.CLIENT_PROOF, HandshakeType.CLIENT_ABORT
    )
    if htype == HandshakeType.CLIENT_ABORT:
        raise _client_aborted(who, decode_abort(answer))
    try:
        noise.read_message_3(answer)
    except NoiseError:
        raise _refused_proof(who, me) from None
    # Checked only after the PSK: an unknown id, a revoked one and a wrong key all end here,
    # exactly like a wrong secret.
    if not me.roster.holds(peer.node_id, noise.remote_static):
        raise _refused_proof(who, me)
    to_server, to_client = noise.split()
    sealer = RecordSealer(to_client)
    opener = RecordOpener(to_server)
    verdict, reason = decide(peer)
    await stream.write((sealer.seal(RecordType.VERDICT, [encode_verdict(verdict, reason)]),))
    return HandshakeResult(peer, sealer, opener, verdict, reason, peer_key=noise.remote_static)


def _client_aborted(who: str, reason: AbortReason | None) -> HandshakeError:
    if reason is AbortReason.BAD_SERVER_PROOF:
        return HandshakeError(
            HandshakeFailure.PEER_REJECTED_PROOF,
            f"{who} refused this node's key: its {ROSTER_KEY} lists another key for this node "
            "id, or none",
        )
    if reason is AbortReason.CLUSTER_MISMATCH:
        return HandshakeError(
            HandshakeFailure.CLUSTER_MISMATCH, f"{who} refused: it belongs to another cluster"
        )
    if reason is AbortReason.UNEXPECTED_PEER:
        return HandshakeError(
            HandshakeFailure.UNEXPECTED_PEER, f"{who} refused: it meant to reach another node"
        )
    return HandshakeError(HandshakeFailure.BAD_HELLO, f"{who} sent a malformed abort")
