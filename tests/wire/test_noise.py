"""Noise_XXpsk3_25519_AESGCM_SHA256 as pure state (``mlxppd/wire/noise.py``): both sides agree,
every altered byte is caught, a wrong PSK shows at message 3, and no static key is sent in clear.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from mlxppd.wire.handshake import prologue
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.noise import PROTOCOL_NAME, NoiseError, NoiseHandshake, nonce_bytes

pytestmark = pytest.mark.timeout(60)

PSK = bytes(range(32))
CLIENT_KEY = NodeKey.generate("client")
SERVER_KEY = NodeKey.generate("server")
HELLO_1, HELLO_2, LAST = b"client hello", b"server hello", b""


def pair(
    *, client_psk: bytes = PSK, server_psk: bytes = PSK
) -> tuple[NoiseHandshake, NoiseHandshake]:
    client = NoiseHandshake(initiator=True, static=CLIENT_KEY, psk=client_psk, prologue=prologue())
    server = NoiseHandshake(initiator=False, static=SERVER_KEY, psk=server_psk, prologue=prologue())
    return client, server


def handshake(
    client: NoiseHandshake,
    server: NoiseHandshake,
    alter: Callable[[int, bytes], bytes] | None = None,
) -> list[bytes]:
    """Run the three messages; ``alter(index, message)`` changes one on its way."""
    change = alter or (lambda _, m: m)
    sent = [change(0, client.write_message_1(HELLO_1))]
    assert server.read_message_1(sent[0]) == HELLO_1
    sent.append(change(1, server.write_message_2(HELLO_2)))
    assert client.read_message_2(sent[1]) == HELLO_2
    sent.append(change(2, client.write_message_3(LAST)))
    assert server.read_message_3(sent[2]) == LAST
    return sent


def test_the_protocol_name_is_the_documented_pattern() -> None:
    assert PROTOCOL_NAME == b"Noise_XXpsk3_25519_AESGCM_SHA256"


def test_both_sides_agree_on_the_keys_the_hash_and_each_others_static_key() -> None:
    client, server = pair()
    handshake(client, server)
    assert client.handshake_hash == server.handshake_hash and len(client.handshake_hash) == 32
    assert client.remote_static == SERVER_KEY.public
    assert server.remote_static == CLIENT_KEY.public
    to_server, to_client = client.split()
    assert server.split() == (to_server, to_client)
    assert to_server != to_client and len(to_server) == len(to_client) == 32
    # The keys work as Noise's AESGCM cipher state does: counter nonces, per direction.
    sealed = AESGCM(to_server).encrypt(nonce_bytes(0), b"first", b"")
    assert AESGCM(to_server).decrypt(nonce_bytes(0), sealed, b"") == b"first"


def test_every_handshake_gets_fresh_keys_from_its_ephemerals() -> None:
    """Same node keys, same PSK: the ephemerals alone make each session's keys its own."""
    sessions = []
    for _ in range(3):
        client, server = pair()
        handshake(client, server)
        sessions.append(client.split())
    assert len(set(sessions)) == 3


@pytest.mark.parametrize("index", [0, 1, 2], ids=["message 1", "message 2", "message 3"])
def test_any_altered_byte_of_any_message_fails_authentication(index: int) -> None:
    length = len(handshake(*pair())[index])
    for offset in range(length):

        def flip(i: int, message: bytes, offset: int = offset) -> bytes:
            if i != index:
                return message
            altered = bytearray(message)
            altered[offset] ^= 0x01
            return bytes(altered)

        with pytest.raises(NoiseError):
            handshake(*pair(), alter=flip)


@pytest.mark.parametrize("index", [0, 1, 2], ids=["message 1", "message 2", "message 3"])
def test_a_message_cut_short_or_extended_fails(index: int) -> None:
    for alter in (lambda m: m[:-1], lambda m: m[:20], lambda m: b"", lambda m: m + b"\x00"):
        with pytest.raises(NoiseError):
            handshake(*pair(), alter=lambda i, m, a=alter: a(m) if i == index else m)


def test_a_wrong_psk_passes_messages_1_and_2_and_fails_at_the_responder_on_message_3() -> None:
    """The PSK is mixed in last: the client learns nothing from message 2 about whether it
    holds the right one, and the server finds out on message 3 (and then sends no verdict)."""
    client, server = pair(client_psk=bytes(32))
    assert server.read_message_1(client.write_message_1(HELLO_1)) == HELLO_1
    assert client.read_message_2(server.write_message_2(HELLO_2)) == HELLO_2
    message_3 = client.write_message_3(LAST)
    with pytest.raises(NoiseError, match="failed authentication"):
        server.read_message_3(message_3)


def test_a_replayed_message_3_does_not_complete_another_session() -> None:
    recorded = handshake(*pair())
    client, server = pair()
    server.read_message_1(recorded[0])  # the recorded opening, replayed
    server.write_message_2(HELLO_2)  # the server answers with a fresh ephemeral
    with pytest.raises(NoiseError):
        server.read_message_3(recorded[2])


def test_the_static_keys_travel_encrypted() -> None:
    client, server = pair()
    sent = b"".join(handshake(client, server))
    assert CLIENT_KEY.public not in sent and SERVER_KEY.public not in sent
    # The search would find a key sent in clear: the ephemerals are.
    assert sent[:32] in sent and sent[:32] != CLIENT_KEY.public


def test_a_degenerate_ephemeral_key_is_refused_not_used() -> None:
    """An all-zero X25519 point would make every DH result zero: a known session key. Message
    1 needs no secret to forge, so a hostile client can send one; the server refuses it."""
    zero = bytes(32)
    forged = NoiseHandshake(
        initiator=True,
        static=CLIENT_KEY,
        psk=PSK,
        prologue=prologue(),
        ephemeral=lambda: _FixedPublic(zero),  # type: ignore[arg-type,return-value]
    )
    message_1 = forged.write_message_1(HELLO_1)
    assert message_1[:32] == zero
    _, server = pair()
    assert server.read_message_1(message_1) == HELLO_1
    with pytest.raises(NoiseError, match="degenerate"):
        server.write_message_2(HELLO_2)


class _FixedPublic:
    """Stands in for an ephemeral private key whose public half is chosen, not derived."""

    def __init__(self, public: bytes):
        self._public = public

    def public_key(self) -> _FixedPublic:
        return self

    def public_bytes(self, *_: object) -> bytes:
        return self._public


def test_the_pre_shared_key_must_be_32_bytes() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        NoiseHandshake(initiator=True, static=CLIENT_KEY, psk=b"short", prologue=prologue())
