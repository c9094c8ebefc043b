"""An attacker on the path between two nodes: every change to a frame closes that connection.

A real TCP proxy sits between client and listener and rewrites the records the client sends.
Each attack must be detected by the listener, counted under its reason, logged once with the
peer's address, close that one connection, and leave the listener serving other peers.
"""

from __future__ import annotations

import logging
import os
import struct

import pytest

from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Message, MessageKind, encode_message
from mlxppd.wire.errors import ChannelClosedError, HandshakeError, PeerAtCapacityError
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.record import RecordSealer, RecordType
from tests.support.wire import (
    CUT,
    Cut,
    TamperProxy,
    assert_serving,
    config,
    eventually,
    flip_bit,
    run,
    serve,
)

pytestmark = pytest.mark.timeout(60)

BACKENDS = ["tcp", "rdma"]
LIMITS = FrameLimits(max_frame_bytes=64 * 1024)


def flip_second(index: int, record: bytes) -> list[bytes | Cut]:
    return [flip_bit(record, 12)] if index == 1 else [record]  # a ciphertext byte


def replay_second(index: int, record: bytes) -> list[bytes | Cut]:
    return [record, record] if index == 1 else [record]


_held: dict[str, bytes] = {}


def swap_second_and_third(index: int, record: bytes) -> list[bytes | Cut]:
    if index == 1:
        _held["record"] = record
        return []
    if index == 2:
        return [record, _held.pop("record")]
    return [record]


def drop_second(index: int, record: bytes) -> list[bytes | Cut]:
    return [] if index == 1 else [record]


def inject_before_second(index: int, record: bytes) -> list[bytes | Cut]:
    if index != 1:
        return [record]
    # A well-formed record sealed under a key of another session.
    forged = encode_message(Message(MessageKind.CONTROL, {"n": 99}), FrameLimits())
    return [RecordSealer(os.urandom(32)).seal(RecordType.MESSAGE, [forged.head]), record]


def truncate_second(index: int, record: bytes) -> list[bytes | Cut]:
    return [record[: len(record) // 2], CUT] if index == 1 else [record]


def oversize_second(index: int, record: bytes) -> list[bytes | Cut]:
    if index != 1:
        return [record]
    too_long = LIMITS.max_frame_bytes + 16 + 1
    return [record[:4] + struct.pack(">I", too_long) + record[8:]]


ATTACKS = [
    # (name, tamper, reason counted by the listener, messages the listener saw before it)
    ("bit flipped", flip_second, "bad_tag", [0]),
    ("replayed", replay_second, "bad_tag", [0, 1]),
    ("reordered", swap_second_and_third, "bad_tag", [0]),
    ("dropped", drop_second, "bad_tag", [0]),
    ("injected", inject_before_second, "bad_tag", [0]),
    ("truncated", truncate_second, "truncated", [0]),
    ("length beyond the maximum", oversize_second, "length_exceeds_max", [0]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("attack", "reason", "seen"), [a[1:] for a in ATTACKS], ids=[a[0] for a in ATTACKS]
)
def test_a_tampered_frame_closes_only_its_connection(
    backend: str, attack: object, reason: str, seen: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mlxppd.wire")
    received: list[int] = []

    async def record_and_echo(channel: SecureChannel) -> None:
        async for message in channel:
            if "n" in message.meta:  # not the good peer's ping
                received.append(message.meta["n"])
            await channel.send(MessageKind.REPLY, message.meta)

    async def scenario() -> None:
        server = create_transport(backend, config("server", limits=LIMITS))
        client = create_transport(backend, config("client", limits=LIMITS))
        async with await serve(server, record_and_echo) as listener:
            async with TamperProxy(listener.address, c2s=attack) as proxy:  # type: ignore[arg-type]
                channel = await client.connect(*proxy.address)
                for n in range(3):
                    await channel.send(MessageKind.CONTROL, {"n": n})
                replies = []
                with pytest.raises(ChannelClosedError) as closed:
                    while True:
                        replies.append((await channel.recv()).meta["n"])
                assert not closed.value.clean  # the listener hung up; it did not say goodbye
                await channel.close()
            assert received == seen
            assert replies == seen[: len(replies)]
            assert dict(server.stats.rejected_frames) == {reason: 1}
            assert not server.stats.handshake_failures
            await assert_serving(listener, backend)
            await eventually(lambda: listener.active == 0)

    run(scenario)
    rejections = [r for r in caplog.records if "rejected a frame" in r.getMessage()]
    assert len(rejections) == 1, "logged exactly once"
    assert "127.0.0.1:" in rejections[0].getMessage() and reason in rejections[0].getMessage()


def _flip_only_after_verdict(index: int, record: bytes) -> list[bytes | Cut]:
    return [flip_bit(record, 9)] if index >= 1 else [record]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tampered_reply_is_rejected_by_the_client(backend: str) -> None:
    """Tampering works the same in the other direction: the client detects and counts it."""

    async def scenario() -> None:
        server = create_transport(backend, config("server"))
        client = create_transport(backend, config("client"))
        async with (
            await serve(server) as listener,
            TamperProxy(listener.address, s2c=_flip_only_after_verdict) as proxy,
        ):
            channel = await client.connect(*proxy.address)
            await channel.send(MessageKind.CONTROL, {"n": 0})
            with pytest.raises(Exception) as error:
                await channel.recv()
            assert getattr(error.value, "reason", None) == "bad_tag"
            assert dict(client.stats.rejected_frames) == {"bad_tag": 1}
            assert channel.closed
            await assert_serving(listener, backend)

    run(scenario)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_connections", [64, 0], ids=["accepted", "at capacity"])
def test_a_tampered_verdict_is_never_taken_for_another(backend: str, max_connections: int) -> None:
    """Flipping the verdict byte (AT_CAPACITY=1 -> ACCEPTED=0) only breaks the tag."""

    def flip_verdict(index: int, record: bytes) -> list[bytes | Cut]:
        return [flip_bit(record, 8)] if index == 0 else [record]  # first plaintext byte

    async def scenario() -> None:
        server = create_transport(backend, config("server", max_connections=max_connections))
        client = create_transport(backend, config("client"))
        async with await serve(server) as listener:
            async with TamperProxy(listener.address, s2c=flip_verdict) as proxy:
                with pytest.raises(HandshakeError) as error:
                    await client.connect(*proxy.address)
            assert error.value.reason == "bad_verdict"
            assert error.value.frame_error is not None
            assert error.value.frame_error.reason == "bad_tag"
            assert dict(client.stats.handshake_failures) == {"bad_verdict": 1}
            assert dict(client.stats.rejected_frames) == {"bad_tag": 1}
            if max_connections:
                await assert_serving(listener, backend)
            else:  # untampered, the same listener answers "at capacity", authentically
                with pytest.raises(PeerAtCapacityError):
                    await client.connect(*listener.address)

    run(scenario)
