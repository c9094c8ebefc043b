"""Noise_XXpsk3_25519_AESGCM_SHA256, as pure state (no I/O): the handshake of protocol 2.

The pattern (the Noise Protocol Framework, revision 34, sections 5, 7 and 9)::

    -> e
    <- e, ee, s, es
    -> s, se, psk

Both sides send an ephemeral X25519 key; the session keys come from ``ee`` (ephemeral with
ephemeral, so they cannot be recomputed later from anything long-term: forward secrecy), mixed
with both node keys (``es``, ``se``: each side proves it holds the private half of the key the
roster lists for its id) and the cluster secret as the pre-shared key (``psk``, last, so a
stolen roster or node key alone opens nothing). ``Split`` gives one key per direction; the
record layer (``record.py``) uses them with Noise's AESGCM nonce layout.

Why XX rather than IK: the server learns who the client claims to be only from the first
message, and XX keeps each side's static key encrypted on the wire; it costs one more DH than
IK and no extra round trip in mlxpp's three-message handshake. Why not TLS 1.3 from the
standard library: ``ssl`` cannot mix a pre-shared key with certificates, and it measured
slower here in handshake, decode step and prefill alike (``docs/security.md``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from mlxppd.wire.node_key import NodeKey

__all__ = [
    "DH_BYTES",
    "PROTOCOL_NAME",
    "NoiseError",
    "NoiseHandshake",
    "hkdf2",
    "nonce_bytes",
]

PROTOCOL_NAME = b"Noise_XXpsk3_25519_AESGCM_SHA256"
DH_BYTES = 32
TAG_BYTES = 16
HASH_BYTES = 32

#: Makes an ephemeral private key; tests inject a known one to show what it takes to decrypt.
Ephemeral = Callable[[], X25519PrivateKey]


class NoiseError(Exception):
    """A handshake message failed authentication or was malformed (the caller says which)."""


def nonce_bytes(n: int) -> bytes:
    """Noise's AESGCM nonce: four zero bytes, then the counter as 64-bit big-endian."""
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "big")


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def hkdf2(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    """Noise's HKDF with two outputs."""
    temp = _hmac(chaining_key, ikm)
    out1 = _hmac(temp, b"\x01")
    return out1, _hmac(temp, out1 + b"\x02")


def _hkdf3(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes, bytes]:
    temp = _hmac(chaining_key, ikm)
    out1 = _hmac(temp, b"\x01")
    out2 = _hmac(temp, out1 + b"\x02")
    return out1, out2, _hmac(temp, out2 + b"\x03")


def _public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _dh(private: X25519PrivateKey | NodeKey, public: bytes) -> bytes:
    try:
        if isinstance(private, NodeKey):
            return private.exchange(public)
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:  # a low-order point: the result would be all zeros
        raise NoiseError("a degenerate public key") from None


class _Symmetric:
    """Noise's SymmetricState with its CipherState folded in (section 5.1, 5.2)."""

    def __init__(self, prologue: bytes):
        self.h = PROTOCOL_NAME if len(PROTOCOL_NAME) == HASH_BYTES else _sha(PROTOCOL_NAME)
        self.ck = self.h
        self._k: bytes | None = None
        self._n = 0
        self.mix_hash(prologue)

    def mix_hash(self, data: bytes) -> None:
        self.h = _sha(self.h + data)

    def mix_key(self, ikm: bytes) -> None:
        self.ck, k = hkdf2(self.ck, ikm)
        self._k, self._n = k, 0

    def mix_key_and_hash(self, ikm: bytes) -> None:
        self.ck, temp_h, k = _hkdf3(self.ck, ikm)
        self.mix_hash(temp_h)
        self._k, self._n = k, 0

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        if self._k is None:
            out = plaintext
        else:
            out = AESGCM(self._k).encrypt(nonce_bytes(self._n), plaintext, self.h)
            self._n += 1
        self.mix_hash(out)
        return out

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        if self._k is None:
            out = ciphertext
        else:
            try:
                out = AESGCM(self._k).decrypt(nonce_bytes(self._n), ciphertext, self.h)
            except InvalidTag:
                raise NoiseError("a handshake message failed authentication") from None
            self._n += 1
        self.mix_hash(ciphertext)
        return out

    def split(self) -> tuple[bytes, bytes]:
        return hkdf2(self.ck, b"")


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class NoiseHandshake:
    """One side of an XXpsk3 handshake; call the three message methods in order for the role.

    Initiator: ``write_message_1``, ``read_message_2``, ``write_message_3``, ``split``.
    Responder: ``read_message_1``, ``write_message_2``, ``read_message_3``, ``split``.
    Payloads of messages 2 and 3 are encrypted; message 1's is only bound into the transcript
    (its key is derived from public values), so it must not say anything secret.
    """

    def __init__(
        self,
        *,
        initiator: bool,
        static: NodeKey,
        psk: bytes,
        prologue: bytes,
        ephemeral: Ephemeral = X25519PrivateKey.generate,
    ):
        if len(psk) != 32:
            raise ValueError("the pre-shared key is 32 bytes")
        self.initiator = initiator
        self._s = static
        self._psk = psk
        self._e = ephemeral()
        self._re = b""
        #: the peer's static public key, once message 2 (initiator) or 3 (responder) is read
        self.remote_static = b""
        self._sym = _Symmetric(prologue)

    # psk handshakes mix every sent or received ephemeral into the key as well (section 9.2).
    def _send_e(self) -> bytes:
        e = _public(self._e)
        self._sym.mix_hash(e)
        self._sym.mix_key(e)
        return e

    def _recv_e(self, message: bytes, at: int) -> int:
        if len(message) < at + DH_BYTES:
            raise NoiseError("a short handshake message")
        self._re = message[at : at + DH_BYTES]
        self._sym.mix_hash(self._re)
        self._sym.mix_key(self._re)
        return at + DH_BYTES

    def write_message_1(self, payload: bytes) -> bytes:
        return self._send_e() + self._sym.encrypt_and_hash(payload)

    def read_message_1(self, message: bytes) -> bytes:
        at = self._recv_e(message, 0)
        return self._sym.decrypt_and_hash(message[at:])

    def write_message_2(self, payload: bytes) -> bytes:
        out = self._send_e()
        self._sym.mix_key(_dh(self._e, self._re))  # ee
        out += self._sym.encrypt_and_hash(self._s.public)  # s
        self._sym.mix_key(_dh(self._s, self._re))  # es: responder's s with initiator's e
        return out + self._sym.encrypt_and_hash(payload)

    def read_message_2(self, message: bytes) -> bytes:
        at = self._recv_e(message, 0)
        self._sym.mix_key(_dh(self._e, self._re))  # ee
        end = at + DH_BYTES + TAG_BYTES
        if len(message) < end:
            raise NoiseError("a short handshake message")
        self.remote_static = self._sym.decrypt_and_hash(message[at:end])  # s
        self._sym.mix_key(_dh(self._e, self.remote_static))  # es
        return self._sym.decrypt_and_hash(message[end:])

    def write_message_3(self, payload: bytes) -> bytes:
        out = self._sym.encrypt_and_hash(self._s.public)  # s
        self._sym.mix_key(_dh(self._s, self._re))  # se: initiator's s with responder's e
        self._sym.mix_key_and_hash(self._psk)  # psk
        return out + self._sym.encrypt_and_hash(payload)

    def read_message_3(self, message: bytes) -> bytes:
        end = DH_BYTES + TAG_BYTES
        if len(message) < end + TAG_BYTES:
            raise NoiseError("a short handshake message")
        self.remote_static = self._sym.decrypt_and_hash(message[:end])  # s
        self._sym.mix_key(_dh(self._e, self.remote_static))  # se
        self._sym.mix_key_and_hash(self._psk)  # psk
        return self._sym.decrypt_and_hash(message[end:])

    def split(self) -> tuple[bytes, bytes]:
        """(initiator-to-responder key, responder-to-initiator key); the state is erased."""
        keys = self._sym.split()
        self._sym = _Symmetric(b"")  # the chaining key and ephemeral go with the old state
        self._e = X25519PrivateKey.generate()
        return keys

    @property
    def handshake_hash(self) -> bytes:
        """The transcript hash ``h`` (channel binding)."""
        return self._sym.h
