"""The handshake's pure parts (protocol 2): envelopes, hello payloads, the PSK, the prologue and
verdicts. The Noise state machine itself is ``test_noise.py``; the exchange over sockets is
``test_handshake_hostile.py`` and ``test_node_identity.py``."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxppd.wire.errors import FrameError, HandshakeError
from mlxppd.wire.handshake import (
    ENVELOPE,
    MAGIC,
    MAX_BODY,
    MAX_VERDICT_REASON,
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
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.noise import NoiseError, NoiseHandshake
from mlxppd.wire.version import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(30)

CLIENT = Hello(0, "cluster", "coordinator")
SECRET = b"s" * 32


def test_an_envelope_is_laid_out_as_documented() -> None:
    message = pack_envelope(HandshakeType.CLIENT_HELLO, b"body")
    assert message == MAGIC + bytes([0, PROTOCOL_VERSION, 1, 0, 0, 4]) + b"body"
    assert parse_envelope(message[: ENVELOPE.size]).body_len == 4
    with pytest.raises(ValueError, match="exceeds"):
        pack_envelope(HandshakeType.CLIENT_HELLO, b"x" * (MAX_BODY + 1))


def test_a_hello_payload_is_laid_out_as_documented_and_parses_back() -> None:
    payload = encode_hello(Hello(1, "cluster", "coordinator"))
    assert payload == b"\x00\x01" + b"\x07cluster" + b"\x0bcoordinator"
    assert decode_hello(payload) == Hello(1, "cluster", "coordinator")


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00\x00",  # no names
        b"\x00\x00\x07cluster",  # no node id
        b"\x00\x00\x07cluster\x06stage",  # node id shorter than its length
        b"\x00\x00\x07cluster\x04n de",  # space in a node id
        b"\x00\x00\x07cluster\x00",  # empty node id
        b"\x00\x00\x02\xff\xfe\x01n",  # cluster name not UTF-8
        b"\x00\x00\x07cluster\x01nX",  # trailing bytes
    ],
    ids=["empty", "no names", "no node id", "short", "space", "empty id", "not utf-8", "trailing"],
)
def test_malformed_hellos_are_refused(body: bytes) -> None:
    with pytest.raises(HandshakeError) as error:
        decode_hello(body)
    assert error.value.reason == "bad_hello"


def test_an_envelope_of_another_version_is_read_no_further_than_its_version() -> None:
    other = ENVELOPE.pack(MAGIC, PROTOCOL_VERSION + 1, 1, 7, 9999)  # its rest may differ
    assert parse_envelope(other).version == PROTOCOL_VERSION + 1
    assert parse_envelope(other).body_len == 0
    protocol_1 = ENVELOPE.pack(MAGIC, 1, 1, 0, 40)
    assert parse_envelope(protocol_1).version == 1  # named in the refusal, never parsed
    with pytest.raises(HandshakeError, match="does not speak") as error:
        parse_envelope(b"HTTP/1.1 2")
    assert error.value.reason == "bad_magic"
    for bad in (
        ENVELOPE.pack(MAGIC, PROTOCOL_VERSION, 1, 1, 0),  # reserved byte set
        ENVELOPE.pack(MAGIC, PROTOCOL_VERSION, 1, 0, MAX_BODY + 1),  # body beyond the bound
    ):
        with pytest.raises(HandshakeError) as error:
            parse_envelope(bad)
        assert error.value.reason == "bad_hello"


def test_the_psk_is_hkdf_sha256_of_the_cluster_secret_with_its_own_labels() -> None:
    expected = HKDF(hashes.SHA256(), 32, salt=b"mlxpp wire psk", info=b"mlxpp/2 noise psk")
    assert psk_from_secret(SECRET) == expected.derive(SECRET)
    assert psk_from_secret(SECRET) != SECRET and len(psk_from_secret(SECRET)) == 32
    assert psk_from_secret(b"t" * 32) != psk_from_secret(SECRET)


def test_the_prologue_binds_the_protocol_version() -> None:
    """The transcript starts with the version: a responder of another version cannot open
    even message 1, so a version rewritten on the path cannot go unnoticed."""
    assert prologue() == MAGIC + PROTOCOL_VERSION.to_bytes(2, "big")
    psk = psk_from_secret(SECRET)
    client = NoiseHandshake(initiator=True, static=NodeKey.generate(), psk=psk, prologue=prologue())
    server = NoiseHandshake(
        initiator=False,
        static=NodeKey.generate(),
        psk=psk,
        prologue=prologue(PROTOCOL_VERSION + 1),
    )
    with pytest.raises(NoiseError):
        server.read_message_1(client.write_message_1(encode_hello(CLIENT)))


def test_the_hello_in_message_1_is_bound_even_though_anyone_can_read_it() -> None:
    """Message 1's payload is sealed under a key made of public values only: not secret, but
    any change to it (the node id, the RDMA version) fails there and then."""
    psk = psk_from_secret(SECRET)
    payload = encode_hello(CLIENT)
    message = NoiseHandshake(
        initiator=True, static=NodeKey.generate(), psk=psk, prologue=prologue()
    ).write_message_1(payload)
    assert len(message) == 32 + len(payload) + 16
    for offset in (0, 32, len(message) - 1):  # the ephemeral key, the payload, the tag
        altered = bytearray(message)
        altered[offset] ^= 1
        server = NoiseHandshake(
            initiator=False, static=NodeKey.generate(), psk=psk, prologue=prologue()
        )
        with pytest.raises(NoiseError):
            server.read_message_1(bytes(altered))


def test_abort_bodies_are_one_known_byte() -> None:
    for reason in AbortReason:
        assert decode_abort(bytes([reason])) is reason
    for bad in (b"", b"\x00", b"\x09", b"\x01\x01"):
        assert decode_abort(bad) is None


def test_verdicts_round_trip_and_malformed_ones_are_rejected() -> None:
    for verdict in Verdict:
        assert decode_verdict(encode_verdict(verdict, "why")) == (verdict, "why")
    assert encode_verdict(Verdict.AT_CAPACITY, "") == b"\x01\x00\x00"
    long = encode_verdict(Verdict.REFUSED, "é" * 1000)
    assert len(long) <= 3 + MAX_VERDICT_REASON
    assert decode_verdict(long)[1] == "é" * (MAX_VERDICT_REASON // 2)
    for bad in (b"", b"\x00", b"\x07\x00\x00", b"\x00\x00\x05ab", b"\x00\x00\x01\xff"):
        with pytest.raises(FrameError) as error:
            decode_verdict(bad)
        assert error.value.reason == "bad_verdict"
