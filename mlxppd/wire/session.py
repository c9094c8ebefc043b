"""Running the handshake over a byte stream, for either role.

    client                                   server
    CLIENT_HELLO  ------------------------>
                  <------------------------  SERVER_HELLO, SERVER_PROOF
    CLIENT_PROOF (or CLIENT_ABORT) ------->
                  <------------------------  record 0: VERDICT (AES-GCM, server-to-client key)

A version mismatch is answered with VERSION_REFUSED before anything else. Both sides refuse a
peer whose proof does not match (different secrets), whose cluster name differs, or (client
side) that is not the node it meant to reach. Errors are raised, never logged or counted here:
the transport does that once per connection.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

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
    NONCE_BYTES,
    PROOF_BYTES,
    AbortReason,
    HandshakeType,
    Hello,
    Verdict,
    compute_proof,
    decode_abort,
    decode_hello,
    decode_verdict,
    derive_keys,
    encode_hello,
    encode_verdict,
    pack_envelope,
    parse_envelope,
    transcript,
    verify_proof,
)
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.record import RecordOpener, RecordSealer, RecordType
from mlxppd.wire.secret import ClusterSecret
from mlxppd.wire.streams import ByteStream, StreamEOF
from mlxppd.wire.version import PROTOCOL_VERSION

__all__ = ["HandshakeResult", "Identity", "client_handshake", "server_handshake"]

#: Decides the verdict for an authenticated peer: (verdict, reason shown to the peer).
Decide = Callable[[Hello], tuple[Verdict, str]]


@dataclass(frozen=True)
class Identity:
    """Who this node is, and what it proves that with."""

    cluster_name: str
    node_id: str
    secret: ClusterSecret
    limits: FrameLimits
    rdma_version: int = 0


@dataclass
class HandshakeResult:
    """An accepted connection: the peer's hello and this side's record directions."""

    peer: Hello
    sealer: RecordSealer
    opener: RecordOpener
    verdict: Verdict = Verdict.ACCEPTED
    reason: str = ""


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


async def client_handshake(
    stream: ByteStream, me: Identity, *, expected_peer: str | None = None
) -> HandshakeResult:
    """Authenticate to a server and read its verdict; raises unless accepted."""
    client_hello = encode_hello(
        HandshakeType.CLIENT_HELLO,
        Hello(os.urandom(NONCE_BYTES), me.rdma_version, me.cluster_name, me.node_id),
    )
    await stream.write((client_hello,))
    _, server_hello, body = await _read_envelope(stream, HandshakeType.SERVER_HELLO)
    peer = decode_hello(body)
    _, _, proof = await _read_envelope(stream, HandshakeType.SERVER_PROOF)
    who = _who(stream, peer)
    seen = transcript(client_hello, server_hello)
    secret = me.secret.key_bytes()

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
    if len(proof) != PROOF_BYTES or not verify_proof(secret, "server", seen, proof):
        await abort(
            AbortReason.BAD_SERVER_PROOF,
            HandshakeFailure.BAD_PROOF,
            f"{who} failed authentication: its proof does not match this node's cluster "
            f"secret (from {me.secret.origin}); give both hosts the same secret file",
        )
    if expected_peer is not None and peer.node_id != expected_peer:
        await abort(
            AbortReason.UNEXPECTED_PEER,
            HandshakeFailure.UNEXPECTED_PEER,
            f"{who} answered, but this node meant to reach node {quoted(expected_peer)}",
        )
    proof_msg = pack_envelope(HandshakeType.CLIENT_PROOF, compute_proof(secret, "client", seen))
    await stream.write((proof_msg,))
    keys = derive_keys(secret, seen)
    sealer = RecordSealer(keys.client_to_server)
    opener = RecordOpener(keys.server_to_client)
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
            f"{who} sent a verdict that failed checks: {exc}",
            frame_error=exc,
        ) from None
    except ChannelClosedError:
        raise HandshakeError(
            HandshakeFailure.CLOSED, f"{who} closed the connection before its verdict"
        ) from None
    if verdict is Verdict.AT_CAPACITY:
        raise PeerAtCapacityError(f"{who} is at capacity ({quoted(reason)}); retry later")
    if verdict is Verdict.REFUSED:
        raise HandshakeError(HandshakeFailure.REFUSED, f"{who} refused this node: {quoted(reason)}")
    return HandshakeResult(peer, sealer, opener)


async def server_handshake(stream: ByteStream, me: Identity, decide: Decide) -> HandshakeResult:
    """Authenticate a client and send it a verdict.

    Returns for every authenticated client, whatever the verdict (the caller closes a refused
    one); raises ``HandshakeError`` when the client could not be authenticated.
    """
    try:
        _, client_hello, body = await _read_envelope(stream, HandshakeType.CLIENT_HELLO)
    except VersionMismatchError:
        # Answer with our version so the other side can name it too, then give up.
        with contextlib.suppress(OSError):
            await stream.write((pack_envelope(HandshakeType.VERSION_REFUSED),))
        raise
    peer = decode_hello(body)
    server_hello = encode_hello(
        HandshakeType.SERVER_HELLO,
        Hello(os.urandom(NONCE_BYTES), me.rdma_version, me.cluster_name, me.node_id),
    )
    seen = transcript(client_hello, server_hello)
    secret = me.secret.key_bytes()
    proof = pack_envelope(HandshakeType.SERVER_PROOF, compute_proof(secret, "server", seen))
    await stream.write((server_hello, proof))
    who = _who(stream, peer)
    if peer.cluster_name != me.cluster_name:
        raise HandshakeError(HandshakeFailure.CLUSTER_MISMATCH, _mismatch(who, peer, me))
    htype, _, answer = await _read_envelope(
        stream, HandshakeType.CLIENT_PROOF, HandshakeType.CLIENT_ABORT
    )
    if htype == HandshakeType.CLIENT_ABORT:
        raise _client_aborted(who, decode_abort(answer))
    keys = derive_keys(secret, seen)
    sealer = RecordSealer(keys.server_to_client)
    opener = RecordOpener(keys.client_to_server)
    if len(answer) != PROOF_BYTES or not verify_proof(secret, "client", seen, answer):
        # Authenticated refusal: readable only by a client holding the same secret, i.e. one
        # whose proof was damaged on the way.
        with contextlib.suppress(OSError):
            await stream.write((sealer.seal(RecordType.VERDICT, [_refusal("bad proof")]),))
        raise HandshakeError(
            HandshakeFailure.BAD_PROOF,
            f"{who} failed authentication: its proof does not match this node's cluster "
            f"secret (from {me.secret.origin}); give both hosts the same secret file",
        )
    verdict, reason = decide(peer)
    await stream.write((sealer.seal(RecordType.VERDICT, [encode_verdict(verdict, reason)]),))
    return HandshakeResult(peer, sealer, opener, verdict, reason)


def _refusal(reason: str) -> bytes:
    return encode_verdict(Verdict.REFUSED, reason)


def _client_aborted(who: str, reason: AbortReason | None) -> HandshakeError:
    if reason is AbortReason.BAD_SERVER_PROOF:
        return HandshakeError(
            HandshakeFailure.PEER_REJECTED_PROOF,
            f"{who} rejected this node's proof: the two hold different cluster secrets",
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
