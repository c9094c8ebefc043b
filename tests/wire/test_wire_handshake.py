"""The handshake's pure parts: layouts, transcript binding, proofs, keys and verdicts."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Literal

import pytest

from mlxppd.wire.errors import FrameError, HandshakeError
from mlxppd.wire.handshake import (
    ENVELOPE,
    MAGIC,
    MAX_VERDICT_REASON,
    HandshakeType,
    Hello,
    Verdict,
    compute_proof,
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
from mlxppd.wire.version import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 32
CLIENT = Hello(b"\x01" * 32, 0, "cluster", "coordinator")
SERVER = Hello(b"\x02" * 32, 1, "cluster", "stage-0")


def _t(client: Hello = CLIENT, server: Hello = SERVER) -> bytes:
    return transcript(
        encode_hello(HandshakeType.CLIENT_HELLO, client),
        encode_hello(HandshakeType.SERVER_HELLO, server),
    )


def test_a_hello_is_laid_out_as_documented_and_parses_back() -> None:
    message = encode_hello(HandshakeType.CLIENT_HELLO, CLIENT)
    body = b"\x01" * 32 + b"\x00\x00" + b"\x07cluster" + b"\x0bcoordinator"
    assert message == MAGIC + bytes([0, PROTOCOL_VERSION, 1, 0, 0, len(body)]) + body
    assert decode_hello(body) == CLIENT


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00" * 34,  # no names
        b"\x00" * 34 + b"\x07cluster",  # no node id
        b"\x00" * 34 + b"\x07cluster\x06stage",  # node id shorter than its length
        b"\x00" * 34 + b"\x07cluster\x04n de",  # space in a node id
        b"\x00" * 34 + b"\x07cluster\x00",  # empty node id
        b"\x00" * 34 + b"\x02\xff\xfe\x01n",  # cluster name not UTF-8
        b"\x00" * 34 + b"\x07cluster\x01nX",  # trailing bytes
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
    with pytest.raises(HandshakeError, match="does not speak") as error:
        parse_envelope(b"HTTP/1.1 2")
    assert error.value.reason == "bad_magic"
    with pytest.raises(HandshakeError) as error:
        parse_envelope(ENVELOPE.pack(MAGIC, PROTOCOL_VERSION, 1, 1, 0))  # reserved byte set
    assert error.value.reason == "bad_hello"
    proof = pack_envelope(HandshakeType.SERVER_PROOF, b"p" * 32)
    assert parse_envelope(proof[: ENVELOPE.size]).body_len == 32


@pytest.mark.parametrize(
    "change",
    [
        {"nonce": b"\x09" * 32},
        {"rdma_version": 7},
        {"cluster_name": "cluster2"},
        {"node_id": "stage-1"},
    ],
    ids=["nonce", "rdma version", "cluster name", "node id"],
)
@pytest.mark.parametrize("side", ["client", "server"])
def test_the_proofs_and_keys_bind_every_hello_field(change: dict[str, object], side: str) -> None:
    changed = (
        _t(client=dataclasses.replace(CLIENT, **change))  # type: ignore[arg-type]
        if side == "client"
        else _t(server=dataclasses.replace(SERVER, **change))  # type: ignore[arg-type]
    )
    roles: tuple[Literal["client", "server"], ...] = ("client", "server")
    for role in roles:
        assert compute_proof(SECRET, role, changed) != compute_proof(SECRET, role, _t())
    assert (
        derive_keys(SECRET, changed).client_to_server != derive_keys(SECRET, _t()).client_to_server
    )


def test_the_proofs_bind_the_protocol_version() -> None:
    hello = encode_hello(HandshakeType.CLIENT_HELLO, CLIENT)
    other_version = hello[:4] + (PROTOCOL_VERSION + 1).to_bytes(2, "big") + hello[6:]
    server = encode_hello(HandshakeType.SERVER_HELLO, SERVER)
    assert compute_proof(SECRET, "server", transcript(other_version, server)) != compute_proof(
        SECRET, "server", transcript(hello, server)
    )


def test_a_proof_is_an_hmac_sha256_of_a_role_label_and_the_transcript() -> None:
    seen = _t()
    expected = hmac.new(SECRET, b"mlxpp/1 server proof\x00" + seen, hashlib.sha256).digest()
    assert compute_proof(SECRET, "server", seen) == expected
    assert (
        compute_proof(SECRET, "client", seen) != expected
    )  # one role's proof never passes as the other's
    assert verify_proof(SECRET, "server", seen, expected)
    assert not verify_proof(SECRET, "client", seen, expected)
    assert not verify_proof(b"t" * 32, "server", seen, expected)


def test_each_connection_and_direction_gets_its_own_key() -> None:
    keys = derive_keys(SECRET, _t())
    assert keys == derive_keys(SECRET, _t())  # both ends derive the same keys
    assert keys.client_to_server != keys.server_to_client
    assert len(keys.client_to_server) == len(keys.server_to_client) == 32
    fresh = derive_keys(SECRET, _t(server=dataclasses.replace(SERVER, nonce=b"\x03" * 32)))
    assert fresh.client_to_server != keys.client_to_server
    assert keys.client_to_server.hex() not in repr(keys)


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
