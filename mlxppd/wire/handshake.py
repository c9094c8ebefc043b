"""The handshake's byte layouts, as pure functions (no I/O); the cryptography is ``noise.py``.

Every handshake message is an envelope (docs/protocol.md, "Handshake")::

    4   magic        b"MXPP"
    u16 version      PROTOCOL_VERSION of the sender
    u8  type         HandshakeType
    u8  reserved     0
    u16 body_len     0..MAX_BODY
    ... body

The envelope keeps this layout in every version (only bodies change), so two nodes of different
versions can always name each other's version before refusing.

Since protocol 2 the bodies of CLIENT_HELLO, SERVER_HELLO and CLIENT_PROOF are the three
messages of a Noise XXpsk3 handshake; the hello *payloads* inside them carry the sender's RDMA
protocol version, the cluster name and the node id. The prologue binds the protocol version.
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxppd.core.log_text import quoted
from mlxppd.wire.errors import FrameError, FrameRejectReason, HandshakeError, HandshakeFailure
from mlxppd.wire.version import PROTOCOL_VERSION

__all__ = [
    "ENVELOPE",
    "MAGIC",
    "MAX_BODY",
    "MAX_VERDICT_REASON",
    "AbortReason",
    "Envelope",
    "HandshakeType",
    "Hello",
    "Verdict",
    "decode_abort",
    "decode_hello",
    "decode_verdict",
    "encode_hello",
    "encode_verdict",
    "pack_envelope",
    "parse_envelope",
    "prologue",
    "psk_from_secret",
    "valid_name",
]

MAGIC = b"MXPP"
ENVELOPE = struct.Struct(">4sHBBH")
MAX_BODY = 1024
MAX_VERDICT_REASON = 512
_HELLO_FIXED = struct.Struct(">H")
_VERDICT = struct.Struct(">BH")
_NAME_LIMIT = 255
# Node ids as in the cluster TOML; cluster names too, since both are logged on receipt.
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")

# Domain separation: the PSK derived from the cluster secret is used for nothing else (the
# admin API derives its own key with other labels).
PSK_SALT = b"mlxpp wire psk"
PSK_INFO = b"mlxpp/2 noise psk"


class HandshakeType(enum.IntEnum):
    """Handshake message types; wire values are fixed (docs/protocol.md)."""

    CLIENT_HELLO = 1  # Noise message 1: -> e (payload: the client's hello)
    SERVER_HELLO = 2  # Noise message 2: <- e, ee, s, es (payload: the server's hello)
    # 3 was protocol 1's SERVER_PROOF; never sent since protocol 2
    CLIENT_PROOF = 4  # Noise message 3: -> s, se, psk (empty payload)
    CLIENT_ABORT = 5  # the client refuses the server; body: one AbortReason byte
    VERSION_REFUSED = 6  # the sender speaks another version; empty body


class AbortReason(enum.IntEnum):
    """Why a client refuses a server after its hello."""

    BAD_SERVER_PROOF = 1  # the server's static key is not the roster's key for its node id
    CLUSTER_MISMATCH = 2
    UNEXPECTED_PEER = 3


class Verdict(enum.IntEnum):
    """The server's answer, sent as the first encrypted record (so it is authenticated)."""

    ACCEPTED = 0
    AT_CAPACITY = 1
    REFUSED = 2


@dataclass(frozen=True)
class Envelope:
    version: int
    type: int
    body_len: int


@dataclass(frozen=True)
class Hello:
    """The payload of a client or server hello."""

    rdma_version: int
    cluster_name: str
    node_id: str


def pack_envelope(
    htype: HandshakeType, body: bytes = b"", *, version: int = PROTOCOL_VERSION
) -> bytes:
    """One whole handshake message."""
    if len(body) > MAX_BODY:
        raise ValueError(f"handshake body of {len(body)} bytes exceeds {MAX_BODY}")
    return ENVELOPE.pack(MAGIC, version, htype, 0, len(body)) + body


def parse_envelope(prefix: bytes) -> Envelope:
    """Check the 10 envelope bytes; the caller compares the version (to name both)."""
    magic, version, htype, reserved, body_len = ENVELOPE.unpack(prefix)
    if magic != MAGIC:
        raise HandshakeError(
            HandshakeFailure.BAD_MAGIC, "the peer does not speak the mlxpp wire protocol"
        )
    if version == PROTOCOL_VERSION and (reserved != 0 or body_len > MAX_BODY):
        raise HandshakeError(HandshakeFailure.BAD_HELLO, "malformed handshake envelope")
    # A different version may lay out the rest differently; only its magic and version count.
    return Envelope(version, htype, body_len if version == PROTOCOL_VERSION else 0)


def _pack_name(text: str) -> bytes:
    raw = text.encode()
    if not 1 <= len(raw) <= _NAME_LIMIT:
        raise ValueError(f"'{text}' must be 1 to {_NAME_LIMIT} bytes of UTF-8")
    return bytes([len(raw)]) + raw


def encode_hello(hello: Hello) -> bytes:
    """A hello payload: u16 RDMA version, then cluster name and node id (u8 length each)."""
    return (
        _HELLO_FIXED.pack(hello.rdma_version)
        + _pack_name(hello.cluster_name)
        + _pack_name(hello.node_id)
    )


def valid_name(text: str) -> bool:
    """Whether ``text`` may be a cluster name or node id in a hello (pure)."""
    return bool(_NAME_RE.fullmatch(text)) and len(text) <= _NAME_LIMIT


def decode_hello(body: bytes) -> Hello:
    """Parse a hello body; anything malformed is ``HandshakeError(bad_hello)``.

    The cluster name and node id must be ``[A-Za-z0-9._-]+``; the error shows an offending
    one escaped (``quoted``), since it is the peer's text and ends up in a log line.
    """
    try:
        (rdma_version,) = _HELLO_FIXED.unpack_from(body)
        pos = _HELLO_FIXED.size
        names = []
        for _ in range(2):
            n = body[pos]
            raw = body[pos + 1 : pos + 1 + n]
            if n == 0 or len(raw) != n:
                raise ValueError("short name")
            names.append(raw.decode("utf-8"))
            pos += 1 + n
        if pos != len(body):
            raise ValueError("bad layout")
    except (struct.error, IndexError, ValueError):
        raise HandshakeError(HandshakeFailure.BAD_HELLO, "malformed hello from the peer") from None
    for what, name in zip(("cluster name", "node id"), names, strict=True):
        if not _NAME_RE.fullmatch(name):
            raise HandshakeError(
                HandshakeFailure.BAD_HELLO,
                f"malformed hello from the peer: its {what} {quoted(name)} holds "
                "characters outside [A-Za-z0-9._-]",
            )
    return Hello(rdma_version, names[0], names[1])


def decode_abort(body: bytes) -> AbortReason | None:
    """The reason in a client abort body, or None when malformed."""
    if len(body) == 1 and body[0] in AbortReason._value2member_map_:
        return AbortReason(body[0])
    return None


def prologue(version: int = PROTOCOL_VERSION) -> bytes:
    """What the Noise handshake binds before its first message: the protocol and version."""
    return MAGIC + version.to_bytes(2, "big")


def psk_from_secret(secret: bytes) -> bytes:
    """The handshake's 32-byte pre-shared key: HKDF-SHA256 of the cluster secret."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=PSK_SALT, info=PSK_INFO).derive(secret)


def encode_verdict(verdict: Verdict, reason: str = "") -> bytes:
    """The plaintext of a verdict record: u8 verdict, u16 reason length, UTF-8 reason."""
    raw = reason.encode()[:MAX_VERDICT_REASON].decode("utf-8", "ignore").encode()
    return _VERDICT.pack(verdict, len(raw)) + raw


def decode_verdict(plaintext: bytes) -> tuple[Verdict, str]:
    """Parse an authenticated verdict record; malformed is ``FrameError(bad_verdict)``."""
    try:
        value, n = _VERDICT.unpack_from(plaintext)
        if n > MAX_VERDICT_REASON or len(plaintext) != _VERDICT.size + n:
            raise ValueError("bad length")
        return Verdict(value), plaintext[_VERDICT.size :].decode("utf-8")
    except (struct.error, ValueError):
        raise FrameError(FrameRejectReason.BAD_VERDICT, "malformed verdict record") from None
