"""The record layer: AES-256-GCM on every frame after the handshake.

A record on the wire (docs/protocol.md, "Records")::

    u8  type          RecordType
    u8  reserved      0
    u16 reserved      0
    u32 sealed_len    plaintext length + 16, at most max_frame_bytes + 16
    ... ciphertext    sealed_len - 16 bytes
    16  tag           GCM tag over the ciphertext, with the 8 header bytes as associated data

The nonce is never sent: it is the 64-bit count of records already sent in that direction,
big-endian, after four zero bytes. Each direction has its own key (the Noise handshake's
``Split``, ``noise.py``), so a replayed, reordered, dropped or injected record is decrypted with
the wrong nonce and fails its tag, exactly like an altered one.

Rekeying: a sender that has sealed ``rekey_after_records`` records, or held its key
``rekey_after_s`` seconds, seals an empty REKEY record and from the next record on uses
``HKDF(old key, "mlxpp/2 rekey")``; the receiver ratchets the same way on opening it. The ratchet
is one-way, so a key recovered from memory later does not open the records sealed before it;
the sequence numbers continue, so nonces never repeat under one key either.

Two equivalent ways to seal and open are provided: one-shot (``AESGCM``, fastest for small
records) and streaming (``Cipher`` in GCM mode, so a large tensor is encrypted piece by piece
straight from its own memory and decrypted straight into its destination, without a joined copy).
They produce and accept identical bytes.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxppd.wire.errors import FrameError, FrameRejectReason
from mlxppd.wire.limits import FrameLimits

__all__ = [
    "RECORD_HEADER",
    "TAG_SIZE",
    "OpenStream",
    "RecordOpener",
    "RecordSealer",
    "RecordType",
    "SealStream",
    "pack_record_header",
    "parse_record_header",
    "ratchet",
    "record_nonce",
]

RECORD_HEADER = struct.Struct(">BBHI")
_HEADER_SIZE = RECORD_HEADER.size
_NONCE = struct.Struct(">IQ")
TAG_SIZE = 16
_MAX_SEQUENCE = 2**64 - 1
_REKEY_INFO = b"mlxpp/2 rekey"

#: What the record layer accepts as bytes (``collections.abc.Buffer`` needs Python 3.12).
Buffer = bytes | bytearray | memoryview


class RecordType(enum.IntEnum):
    """Record types; wire values are fixed (docs/protocol.md)."""

    VERDICT = 1  # the server's accept / at-capacity / refused answer, always sequence 0
    MESSAGE = 2  # one codec message
    CLOSE = 3  # an authenticated goodbye, so a cut connection is told apart from a closed one
    REKEY = 4  # empty: the sender's next record is sealed with the ratcheted key


_TYPES = {t.value: t for t in RecordType}


def record_nonce(sequence: int) -> bytes:
    """The 12-byte GCM nonce of record number ``sequence`` (0-based) in one direction."""
    if not 0 <= sequence <= _MAX_SEQUENCE:
        raise ValueError(f"record sequence {sequence} outside 0..2**64-1")
    return b"\x00\x00\x00\x00" + sequence.to_bytes(8, "big")


def pack_record_header(record_type: RecordType, plaintext_len: int) -> bytes:
    """The 8 header bytes (also the associated data) of a record of ``plaintext_len`` bytes."""
    return RECORD_HEADER.pack(record_type, 0, 0, plaintext_len + TAG_SIZE)


def parse_record_header(header: Buffer, limits: FrameLimits) -> tuple[RecordType, int]:
    """Check a received record header: its type and plaintext length, bounded by ``limits``.

    Runs before anything is allocated for the record, so the length check is what keeps a peer
    from making this process reserve memory.
    """
    rtype, reserved8, reserved16, sealed_len = RECORD_HEADER.unpack(header)
    if reserved8 or reserved16:
        raise FrameError(FrameRejectReason.BAD_HEADER, "reserved record header bits are set")
    if rtype not in _TYPES:
        raise FrameError(FrameRejectReason.BAD_HEADER, f"unknown record type {rtype}")
    if sealed_len < TAG_SIZE:
        raise FrameError(FrameRejectReason.BAD_HEADER, f"record length {sealed_len} < tag size")
    if sealed_len - TAG_SIZE > limits.max_frame_bytes:
        raise FrameError(
            FrameRejectReason.LENGTH_EXCEEDS_MAX,
            f"record of {sealed_len - TAG_SIZE} bytes; the limit is {limits.max_frame_bytes}",
        )
    return _TYPES[rtype], sealed_len - TAG_SIZE


def ratchet(key: bytes) -> bytes:
    """The key after a REKEY record: one-way, so it does not give back ``key``."""
    return HKDF(hashes.SHA256(), 32, salt=None, info=_REKEY_INFO).derive(key)


class _Direction:
    """One direction's key, record counter and key epoch."""

    def __init__(self, key: bytes):
        if len(key) != 32:
            raise ValueError("record keys are 32 bytes (AES-256)")
        self._key = key
        self._aead = AESGCM(key)
        self._sequence = 0
        #: how many times the key was replaced
        self.epoch = 0
        #: ``sequence`` when the key was last replaced
        self.rekeyed_at_sequence = 0

    @property
    def sequence(self) -> int:
        """Number of records already sealed/opened in this direction."""
        return self._sequence

    @property
    def records_on_key(self) -> int:
        """Records sealed/opened with the current key."""
        return self._sequence - self.rekeyed_at_sequence

    def rekey(self) -> None:
        """Replace the key by its ratchet. Python cannot wipe the old ``bytes``; dropping
        every reference to it (and to its AESGCM context) is what is possible."""
        self._key = ratchet(self._key)
        self._aead = AESGCM(self._key)
        self.epoch += 1
        self.rekeyed_at_sequence = self._sequence

    def key_fingerprint(self) -> bytes:
        """8 bytes that change with the key and do not reveal it (tests compare epochs)."""
        return HKDF(hashes.SHA256(), 8, salt=None, info=b"mlxpp/2 key id").derive(self._key)

    def _next_nonce(self) -> bytes:
        sequence = self._sequence
        if sequence > _MAX_SEQUENCE:
            raise FrameError(
                FrameRejectReason.SEQUENCE_EXHAUSTED, "2**64 records on one connection"
            )
        self._sequence = sequence + 1
        return _NONCE.pack(0, sequence)  # == record_nonce(sequence), without its checks

    def _cipher(self, nonce: bytes) -> Cipher[modes.GCM]:
        return Cipher(algorithms.AES(self._key), modes.GCM(nonce))

    def __repr__(self) -> str:  # never show the key
        return f"{type(self).__name__}(sequence={self._sequence})"


class SealStream:
    """Encrypts one record piece by piece; ``header`` goes first on the wire, ``tag`` last."""

    def __init__(self, cipher: Cipher[modes.GCM], header: bytes, plaintext_len: int):
        self.header = header
        self._remaining = plaintext_len
        self._enc = cipher.encryptor()
        self._enc.authenticate_additional_data(header)

    def update_into(self, src: Buffer, dst: memoryview) -> None:
        """Encrypt all of ``src`` into ``dst`` (exactly as long)."""
        n = self._enc.update_into(src, dst)
        self._remaining -= n

    def finish(self) -> bytes:
        """The tag, after exactly the announced number of plaintext bytes."""
        if self._remaining != 0:
            raise ValueError(f"sealed {self._remaining} bytes fewer/more than announced")
        self._enc.finalize()
        return self._enc.tag


class OpenStream:
    """Decrypts one record piece by piece; nothing it yields is trusted before ``finish``."""

    def __init__(self, cipher: Cipher[modes.GCM], header: bytes):
        self._dec = cipher.decryptor()
        self._dec.authenticate_additional_data(header)

    def update_into(self, src: Buffer, dst: memoryview) -> None:
        """Decrypt all of ``src`` into ``dst`` (exactly as long)."""
        self._dec.update_into(src, dst)

    def finish(self, tag: bytes) -> None:
        """Check the tag; raises ``FrameError(bad_tag)`` when the record is not authentic."""
        try:
            self._dec.finalize_with_tag(tag)
        except InvalidTag:
            raise FrameError(FrameRejectReason.BAD_TAG, "record failed authentication") from None


class RecordSealer(_Direction):
    """The sending direction of a connection."""

    def seal_into(self, record_type: RecordType, parts: Sequence[Buffer], out: memoryview) -> int:
        """One-shot: write header, ciphertext and tag of ``parts`` (joined) into ``out``.

        Returns the record length. Joining copies the parts, so use this for small records.
        """
        plaintext = b"".join(parts)
        sealed_len = len(plaintext) + TAG_SIZE
        header = RECORD_HEADER.pack(record_type, 0, 0, sealed_len)
        out[:_HEADER_SIZE] = header
        self._aead.encrypt_into(
            self._next_nonce(), plaintext, header, out[_HEADER_SIZE : _HEADER_SIZE + sealed_len]
        )
        return _HEADER_SIZE + sealed_len

    def seal(self, record_type: RecordType, parts: Sequence[Buffer]) -> bytes:
        """One-shot, into fresh memory: the whole record as bytes."""
        size = RECORD_HEADER.size + sum(memoryview(p).nbytes for p in parts) + TAG_SIZE
        out = bytearray(size)
        self.seal_into(record_type, parts, memoryview(out))
        return bytes(out)

    def start(self, record_type: RecordType, plaintext_len: int) -> SealStream:
        """Streaming: begin a record of ``plaintext_len`` bytes."""
        header = pack_record_header(record_type, plaintext_len)
        return SealStream(self._cipher(self._next_nonce()), header, plaintext_len)


class RecordOpener(_Direction):
    """The receiving direction of a connection."""

    def open_into(self, header: bytes, sealed: Buffer, out: memoryview) -> None:
        """One-shot: authenticate and decrypt ``sealed`` (ciphertext + tag) into ``out``."""
        try:
            self._aead.decrypt_into(self._next_nonce(), sealed, header, out)
        except InvalidTag:
            raise FrameError(FrameRejectReason.BAD_TAG, "record failed authentication") from None

    def start(self, header: bytes) -> OpenStream:
        """Streaming: begin opening the record whose 8 header bytes are ``header``."""
        return OpenStream(self._cipher(self._next_nonce()), header)
