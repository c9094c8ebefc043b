"""docs/protocol.md and the code agree: every constant, every code table, every reason."""

from __future__ import annotations

import ast
from enum import IntEnum

import pytest

from mlxppd.core.config.cluster import ClusterSection
from mlxppd.wire import handshake, noise, record, secret, streams, version
from mlxppd.wire.channel import RekeyPolicy
from mlxppd.wire.codec import MESSAGE_HEADER, MessageKind
from mlxppd.wire.dtypes import DTYPES
from mlxppd.wire.errors import FrameRejectReason, HandshakeFailure, PreauthRefusal
from mlxppd.wire.handshake import AbortReason, HandshakeType, Verdict
from mlxppd.wire.limits import MAX_NDIM, FrameLimits
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.rdma import negotiate_rdma
from mlxppd.wire.record import RecordType
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(30)

DOC = (REPO_ROOT / "docs" / "protocol.md").read_text()

CODE_CONSTANTS = {
    "PROTOCOL_VERSION": version.PROTOCOL_VERSION,
    "RDMA_PROTOCOL_VERSION": version.RDMA_PROTOCOL_VERSION,
    "MAGIC": handshake.MAGIC,
    "ENVELOPE_BYTES": handshake.ENVELOPE.size,
    "MAX_BODY": handshake.MAX_BODY,
    "MAX_VERDICT_REASON": handshake.MAX_VERDICT_REASON,
    "NOISE_PROTOCOL_NAME": noise.PROTOCOL_NAME,
    "DH_BYTES": noise.DH_BYTES,
    "PSK_SALT": handshake.PSK_SALT,
    "PSK_INFO": handshake.PSK_INFO,
    "REKEY_INFO": record._REKEY_INFO,  # private to the record layer; the doc names it
    "DEFAULT_REKEY_AFTER_RECORDS": RekeyPolicy().after_records,
    "DEFAULT_REKEY_AFTER_S": RekeyPolicy().after_s,
    "RECORD_HEADER_BYTES": record.RECORD_HEADER.size,
    "TAG_BYTES": record.TAG_SIZE,
    "MESSAGE_HEADER_BYTES": MESSAGE_HEADER.size,
    "MAX_NDIM": MAX_NDIM,
    "DEFAULT_MAX_FRAME_BYTES": FrameLimits().max_frame_bytes,
    "DEFAULT_MAX_METADATA_BYTES": FrameLimits().max_metadata_bytes,
    "MIN_SECRET_BYTES": secret.MIN_SECRET_BYTES,
    "HANDSHAKE_BUFFER_BYTES": streams.HANDSHAKE_BUFFER_BYTES,
}


def _tables() -> list[list[list[str]]]:
    """Every markdown table in the doc, as rows of stripped cells (header rows included)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in DOC.splitlines() + [""]:
        if line.startswith("|"):
            current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    return tables


def _unquote(cell: str) -> str:
    return cell.strip("`")


def test_every_documented_constant_has_the_codes_value() -> None:
    table = next(t for t in _tables() if t[0] == ["name", "value"])
    documented = {_unquote(row[0]): ast.literal_eval(_unquote(row[1])) for row in table[2:]}
    assert documented == CODE_CONSTANTS


@pytest.mark.parametrize("enum", [HandshakeType, AbortReason, Verdict, RecordType, MessageKind])
def test_every_code_table_matches_its_enum(enum: type[IntEnum]) -> None:
    expected = {member.name: member.value for member in enum}
    found = [
        {_unquote(row[1]): int(row[0]) for row in table[2:]}
        for table in _tables()
        if table[2:] and all(row[0].isdigit() for row in table[2:])
    ]
    assert expected in found, f"docs/protocol.md has no table for {enum.__name__}"


def test_the_dtype_table_matches_the_code() -> None:
    table = next(t for t in _tables() if t[0] == ["code", "name", "itemsize", "storage"])
    documented = [(int(r[0]), _unquote(r[1]), int(r[2]), _unquote(r[3])) for r in table[2:]]
    assert documented == [(d.code, d.name, d.itemsize, d.storage_name) for d in DTYPES]


def test_every_failure_reason_is_documented_and_nothing_else() -> None:
    table = next(t for t in _tables() if t[0] == ["counter", "reason", "cause"])
    rows = [(r[0], _unquote(r[1])) for r in table[2:]]
    assert {r for c, r in rows if c == "handshake_failures"} == {f.value for f in HandshakeFailure}
    assert {r for c, r in rows if c == "rejected_frames"} == {r.value for r in FrameRejectReason}
    assert {r for c, r in rows if c == "preauth_refused"} == {r.value for r in PreauthRefusal}
    assert {c for c, _ in rows} == {"handshake_failures", "rejected_frames", "preauth_refused"}


def test_the_layout_tables_match_the_struct_formats() -> None:
    assert handshake.ENVELOPE.format == ">4sHBBH"
    assert record.RECORD_HEADER.format == ">BBHI"
    assert MESSAGE_HEADER.format == ">BBBBI"
    assert "| 4 | 4 | sealed_len = plaintext length + 16 |" in DOC
    assert "| 4 | 4 | meta_len, 0..`max_metadata_bytes` (default 4096) |" in DOC
    assert "| 8 | 2 | body_len | 0 .. `MAX_BODY` |" in DOC


def test_the_documented_log_lines_are_the_ones_the_code_writes() -> None:
    host = (
        "rdma_transport: falling back to TCP (reason=os=linux, driver=io_uring_missing: "
        "kernel does not export io_uring_setup (ENOSYS))"
    )
    peer = "rdma_transport: peer negotiation fallback (peer=10.0.0.1:9000, reason={})".format(
        negotiate_rdma(version.RDMA_PROTOCOL_VERSION, 99, "linux")
    )
    assert host in DOC and peer in DOC


def test_the_secret_sources_are_documented_in_lookup_order() -> None:
    positions = [DOC.index(f"{i}. `{source}") for i, source in enumerate(secret.SECRET_SOURCES, 1)]
    assert positions == sorted(positions)
    assert f"hex of at least {secret.MIN_HEX_DIGITS} digits" in DOC
    assert f"at least {secret.MIN_BASE64_CHARS} characters" in DOC
    assert f"at least {secret.MIN_SECRET_BYTES} of them" in DOC


def _noise_messages() -> list[bytes]:
    """The three bodies of a real handshake, for their sizes."""
    psk = handshake.psk_from_secret(b"s" * 32)
    client = noise.NoiseHandshake(
        initiator=True, static=NodeKey.generate(), psk=psk, prologue=handshake.prologue()
    )
    server = noise.NoiseHandshake(
        initiator=False, static=NodeKey.generate(), psk=psk, prologue=handshake.prologue()
    )
    hello = handshake.encode_hello(handshake.Hello(0, "c", "n"))
    sent = [client.write_message_1(hello)]
    server.read_message_1(sent[0])
    sent.append(server.write_message_2(hello))
    client.read_message_2(sent[1])
    sent.append(client.write_message_3(b""))
    server.read_message_3(sent[2])
    return sent


def test_the_handshake_section_matches_the_noise_code() -> None:
    hello = len(handshake.encode_hello(handshake.Hello(0, "c", "n")))
    m1, m2, m3 = (len(m) for m in _noise_messages())
    assert (m1, m2, m3) == (32 + hello + 16, 32 + 48 + hello + 16, 64)
    assert "Message 3, the client's proof (`CLIENT_PROOF` body, always 64 bytes)" in DOC
    assert "| 32 | 48 | the server's static key, encrypted (after `ee`), with its tag |" in DOC
    assert "| 0 | 48 | the client's static key, encrypted (after `es`), with its tag |" in DOC
    assert handshake.prologue() == handshake.MAGIC + version.PROTOCOL_VERSION.to_bytes(2, "big")
    assert "Prologue: `MAGIC || u16 PROTOCOL_VERSION` (6 bytes)" in DOC
    assert len(noise.PROTOCOL_NAME) == 32 and "exactly 32 bytes" in DOC
    assert "`psk = HKDF-SHA256(ikm=cluster secret, salt=PSK_SALT, info=PSK_INFO," in DOC
    assert "next_key = HKDF-SHA256(ikm=key, salt=none, info=REKEY_INFO, length=32)" in DOC


def test_the_rekey_defaults_are_the_cluster_tomls() -> None:
    fields = ClusterSection.model_fields
    assert fields["rekey_after_records"].default == RekeyPolicy().after_records == 2**24
    assert fields["rekey_after_s"].default == RekeyPolicy().after_s == 120.0
    assert "(default 2^24," in DOC and "(default 120," in DOC
