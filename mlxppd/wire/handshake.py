"""The handshake's byte layouts and cryptography, as pure functions (no I/O).

Every handshake message is an envelope (docs/protocol.md, "Handshake")::

    4   magic        b"MXPP"
    u16 version      PROTOCOL_VERSION of the sender
    u8  type         HandshakeType
    u8  reserved     0
    u16 body_len     0..MAX_BODY
    ... body

The envelope keeps this layout in every future version (only bodies may change), so two nodes
of different versions can always name each other's version before refusing.

Both hellos carry a fresh 32-byte nonce, the sender's RDMA protocol version, the cluster name
and the node id. The transcript is the client hello envelope followed by the server hello
envelope, byte for byte as sent, so the proofs and the keys bind the protocol version, the
cluster name, both node ids and both nonces.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import struct
from dataclasses import dataclass
from typing import Literal

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
    "NONCE_BYTES",
    "PROOF_BYTES",
    "AbortReason",
    "Envelope",
    "HandshakeType",
    "Hello",
    "SessionKeys",
    "Verdict",
    "compute_proof",
    "decode_abort",
    "decode_hello",
    "decode_verdict",
    "derive_keys",
    "encode_hello",
    "encode_verdict",
    "pack_envelope",
    "parse_envelope",
    "transcript",
    "valid_name",
    "verify_proof",
]

MAGIC = b"MXPP"
ENVELOPE = struct.Struct(">4sHBBH")
MAX_BODY = 1024
NONCE_BYTES = 32
PROOF_BYTES = 32
MAX_VERDICT_REASON = 512
_HELLO_FIXED = struct.Struct(f">{NONCE_BYTES}sH")
_VERDICT = struct.Struct(">BH")
_NAME_LIMIT = 255
# Node ids as in the cluster TOML; cluster names too, since both are logged on receipt.
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")

# Domain-separation labels: a proof for one role can never pass as the other's, and key
# derivation never reuses a MAC input.
SERVER_PROOF_LABEL = b"mlxpp/1 server proof\x00"
CLIENT_PROOF_LABEL = b"mlxpp/1 client proof\x00"
C2S_KEY_INFO = b"mlxpp/1 key client-to-server"
S2C_KEY_INFO = b"mlxpp/1 key server-to-client"


class HandshakeType(enum.IntEnum):
    """Handshake message types; wire values are fixed (docs/protocol.md)."""

    CLIENT_HELLO = 1
    SERVER_HELLO = 2
    SERVER_PROOF = 3
    CLIENT_PROOF = 4
    CLIENT_ABORT = 5  # the client refuses the server; body: one AbortReason byte
    VERSION_REFUSED = 6  # the sender speaks another version; empty body


class AbortReason(enum.IntEnum):
    """Why a client refuses a server after its hello and proof."""

    BAD_SERVER_PROOF = 1
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
    """The body of a client or server hello."""

    nonce: bytes
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


def encode_hello(htype: HandshakeType, hello: Hello) -> bytes:
    """A client or server hello envelope."""
    if len(hello.nonce) != NONCE_BYTES:
        raise ValueError(f"a hello nonce is {NONCE_BYTES} bytes")
    body = (
        _HELLO_FIXED.pack(hello.nonce, hello.rdma_version)
        + _pack_name(hello.cluster_name)
        + _pack_name(hello.node_id)
    )
    return pack_envelope(htype, body)


def valid_name(text: str) -> bool:
    """Whether ``text`` may be a cluster name or node id in a hello (pure)."""
    return bool(_NAME_RE.fullmatch(text)) and len(text) <= _NAME_LIMIT


def decode_hello(body: bytes) -> Hello:
    """Parse a hello body; anything malformed is ``HandshakeError(bad_hello)``.

    The cluster name and node id must be ``[A-Za-z0-9._-]+``; the error shows an offending
    one escaped (``quoted``), since it is the peer's text and ends up in a log line.
    """
    try:
        nonce, rdma_version = _HELLO_FIXED.unpack_from(body)
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
    return Hello(nonce, rdma_version, names[0], names[1])


def decode_abort(body: bytes) -> AbortReason | None:
    """The reason in a client abort body, or None when malformed."""
    if len(body) == 1 and body[0] in AbortReason._value2member_map_:
        return AbortReason(body[0])
    return None


def transcript(client_hello: bytes, server_hello: bytes) -> bytes:
    """What both proofs and both keys are bound to: the two hello envelopes as sent."""
    return client_hello + server_hello


def compute_proof(secret: bytes, role: Literal["server", "client"], transcript: bytes) -> bytes:
    """HMAC-SHA256 proof that the ``role`` side holds ``secret``, bound to ``transcript``."""
    label = SERVER_PROOF_LABEL if role == "server" else CLIENT_PROOF_LABEL
    return hmac.new(secret, label + transcript, hashlib.sha256).digest()


def verify_proof(
    secret: bytes, role: Literal["server", "client"], transcript: bytes, proof: bytes
) -> bool:
    """Constant-time check of a peer's proof."""
    return hmac.compare_digest(compute_proof(secret, role, transcript), proof)


@dataclass(frozen=True, repr=False)
class SessionKeys:
    """The two AES-256 keys of one connection, one per direction."""

    client_to_server: bytes
    server_to_client: bytes

    def __repr__(self) -> str:
        return "SessionKeys(redacted)"


def derive_keys(secret: bytes, transcript: bytes) -> SessionKeys:
    """HKDF-SHA256 keys for one connection: salt = SHA-256(transcript), info = direction."""
    salt = hashlib.sha256(transcript).digest()

    def one(info: bytes) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(secret)

    return SessionKeys(one(C2S_KEY_INFO), one(S2C_KEY_INFO))


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
