"""Errors of the wire layer, each a member of the project's hierarchy (``mlxppd.core.errors``).

Every error that closes a connection carries a short machine-readable ``reason`` (a
``FrameRejectReason`` or ``HandshakeFailure`` value); the same string keys the counters in
``WireStats``, so a log line, an exception and a metric always agree on what happened.
"""

from __future__ import annotations

import enum

from mlxppd.core.errors import PeerRefusedError, PermanentError, TemporaryError

__all__ = [
    "ChannelClosedError",
    "FrameError",
    "HandshakeError",
    "HandshakeFailure",
    "MessageEncodingError",
    "PeerAtCapacityError",
    "FrameRejectReason",
    "PreauthRefusal",
    "VersionMismatchError",
]


class FrameRejectReason(enum.StrEnum):
    """Why a received frame was rejected (the ``rejected_frames`` counter keys)."""

    BAD_HEADER = "bad_header"  # reserved bits set, unknown record type, length below the tag
    LENGTH_EXCEEDS_MAX = "length_exceeds_max"  # a length field beyond the configured bound
    BAD_TAG = "bad_tag"  # AES-GCM authentication failed: altered, replayed, reordered, ...
    TRUNCATED = "truncated"  # the connection ended inside a frame
    UNEXPECTED_RECORD = "unexpected_record"  # an authentic record of a type not allowed here
    UNSUPPORTED_VERSION = "unsupported_version"  # message header of another protocol version
    UNKNOWN_KIND = "unknown_kind"
    UNKNOWN_DTYPE = "unknown_dtype"
    NDIM_EXCEEDS_MAX = "ndim_exceeds_max"
    METADATA_EXCEEDS_MAX = "metadata_exceeds_max"
    BAD_METADATA = "bad_metadata"  # metadata is not a UTF-8 JSON object
    SIZE_MISMATCH = "size_mismatch"  # shape x itemsize disagrees with the bytes that follow
    BAD_VERDICT = "bad_verdict"  # the verdict record is malformed
    SEQUENCE_EXHAUSTED = "sequence_exhausted"  # 2**64 records in one direction


class HandshakeFailure(enum.StrEnum):
    """Why a handshake failed (the ``handshake_failures`` counter keys)."""

    BAD_MAGIC = "bad_magic"  # not an mlxpp peer at all
    VERSION_MISMATCH = "version_mismatch"
    BAD_HELLO = "bad_hello"  # malformed handshake message
    # the client failed authentication: wrong cluster secret, or a node key the roster does not
    # list for its id (one reason for both, so a refusal tells a prober nothing)
    BAD_PROOF = "bad_proof"
    PEER_REJECTED_PROOF = "peer_rejected_proof"  # the server closed on our proof
    WRONG_NODE_KEY = "wrong_node_key"  # the server's key is not the roster's for its node id
    CLUSTER_MISMATCH = "cluster_mismatch"
    UNEXPECTED_PEER = "unexpected_peer"  # authentic, but not the node we meant to reach
    BAD_VERDICT = "bad_verdict"  # the verdict record failed authentication or parsing
    REFUSED = "refused"  # an authentic refusal verdict
    TIMEOUT = "timeout"
    CLOSED = "closed"  # the connection ended during the handshake


class PreauthRefusal(enum.StrEnum):
    """Why a listener closed a connection before reading it (``preauth_refused`` keys)."""

    HANDSHAKES_IN_PROGRESS = "handshakes_in_progress"  # max_handshakes are already running
    HANDSHAKES_FROM_SOURCE = "handshakes_from_source"  # max_handshakes_per_source from its host


class MessageEncodingError(PermanentError):
    """A local message cannot be put on the wire (too large, bad tensor memory, bad metadata)."""


class FrameError(PermanentError):
    """A received frame was rejected; the connection it came on is closed."""

    def __init__(self, reason: FrameRejectReason, detail: str):
        self.reason = reason
        self.detail = detail
        super().__init__(f"frame rejected ({reason}): {detail}")


class HandshakeError(PeerRefusedError):
    """A connection was not established: one side refused the other."""

    def __init__(
        self, reason: HandshakeFailure, message: str, *, frame_error: FrameError | None = None
    ):
        self.reason = reason
        #: the rejected record, when a frame check (the verdict's) is what failed
        self.frame_error = frame_error
        super().__init__(message)


class VersionMismatchError(HandshakeError):
    """The two ends speak different wire protocol versions; the message names both."""

    def __init__(self, local_version: int, peer_version: int, peer: str):
        self.local_version = local_version
        self.peer_version = peer_version
        super().__init__(
            HandshakeFailure.VERSION_MISMATCH,
            f"peer {peer} speaks mlxpp wire protocol version {peer_version}, this node speaks "
            f"version {local_version}; upgrade every node of the cluster together",
        )


class PeerAtCapacityError(PeerRefusedError, TemporaryError):
    """The peer authenticated us but has no room for another connection; retry later."""


class ChannelClosedError(TemporaryError):
    """The channel is closed: ``clean`` when the peer said goodbye, else the connection dropped."""

    def __init__(self, message: str, *, clean: bool):
        self.clean = clean
        super().__init__(message)
