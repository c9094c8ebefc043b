"""Hostile bytes at every step of the protocol 2 handshake, over real loopback sockets.

    CLIENT_HELLO (-> e)            a hostile client: garbage, oversized, forged, out of turn
    SERVER_HELLO (<- e, ee, s, es) a fake server: garbage, cut short, forged, out of turn
    CLIENT_PROOF (-> s, se, psk)   a hostile client: garbage, cut short, under another envelope
    VERDICT (record 0)             a path attacker: altered, replaced, cut short

Each is refused, counted once in the detecting side's ``WireStats``, and ends only its own
connection: a channel the same node already holds keeps working.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Awaitable, Callable

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import HandshakeError
from mlxppd.wire.handshake import (
    ENVELOPE,
    MAGIC,
    MAX_BODY,
    HandshakeType,
    Hello,
    encode_hello,
    pack_envelope,
    prologue,
    psk_from_secret,
)
from mlxppd.wire.noise import NoiseHandshake
from mlxppd.wire.transport import Listener, Transport
from mlxppd.wire.version import PROTOCOL_VERSION
from tests.support.node_keys import node_key_for
from tests.support.wire import (
    CLUSTER,
    CUT,
    SECRET,
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


class _ZeroPoint:
    """An "ephemeral key" whose public half is the all-zero X25519 point (low order)."""

    def public_key(self) -> _ZeroPoint:
        return self

    def public_bytes(self, *_: object) -> bytes:
        return bytes(32)


def noise_client(ephemeral: Callable[[], X25519PrivateKey] | None = None) -> NoiseHandshake:
    """A listed node's honest handshake state (what a raw client needs for the real steps)."""
    extra = {} if ephemeral is None else {"ephemeral": ephemeral}
    return NoiseHandshake(
        initiator=True,
        static=node_key_for("client"),
        psk=psk_from_secret(SECRET.key_bytes()),
        prologue=prologue(),
        **extra,
    )


def message_1(noise: NoiseHandshake) -> bytes:
    hello = encode_hello(Hello(0, CLUSTER, "client"))
    return pack_envelope(HandshakeType.CLIENT_HELLO, noise.write_message_1(hello))


async def read_message(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    envelope = await reader.readexactly(ENVELOPE.size)
    _, _, htype, _, body_len = ENVELOPE.unpack(envelope)
    return htype, await reader.readexactly(body_len)


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the peer sends before it closes (a reset counts as closed)."""
    data = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await asyncio.wait_for(reader.read(4096), 30):
            data += chunk
    return data


# Each hostile client: (reader, writer) of a fresh connection to the listener -> None.
Attack = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def sends(data: bytes, *, then_eof: bool = False) -> Attack:
    async def attack(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        if then_eof:
            writer.write_eof()
        await writer.drain()

    return attack


def after_message_2(answer: Callable[[bytes], bytes], *, then_eof: bool = False) -> Attack:
    """An honest message 1, the server's message 2 read, then ``answer(message 2 body)``."""

    async def attack(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        noise = noise_client()
        writer.write(message_1(noise))
        htype, body = await read_message(reader)
        assert htype == HandshakeType.SERVER_HELLO
        noise.read_message_2(body)  # the server is genuine; only our last message is not
        writer.write(answer(body))
        if then_eof:
            writer.write_eof()
        await writer.drain()

    return attack


def _degenerate_message_1() -> bytes:
    forged = noise_client(ephemeral=_ZeroPoint)  # type: ignore[arg-type]
    return message_1(forged)


CLIENT_ATTACKS: list[tuple[str, Attack, str]] = [
    # message 1
    ("garbage first bytes", sends(os.urandom(64)), "bad_magic"),
    (
        "first message beyond the body bound",
        sends(struct.pack(">4sHBBH", MAGIC, PROTOCOL_VERSION, 1, 0, MAX_BODY + 1)),
        "bad_hello",
    ),
    (
        "first message as long as the envelope allows",
        sends(struct.pack(">4sHBBH", MAGIC, PROTOCOL_VERSION, 1, 0, 0xFFFF) + bytes(4096)),
        "bad_hello",
    ),
    (
        "garbage Noise message 1",
        sends(pack_envelope(HandshakeType.CLIENT_HELLO, os.urandom(80))),
        "bad_hello",
    ),
    ("message 1 cut short", sends(message_1(noise_client())[:40], then_eof=True), "closed"),
    ("message 1 with a degenerate ephemeral key", sends(_degenerate_message_1()), "bad_hello"),
    (
        "message 3 before message 1",
        sends(pack_envelope(HandshakeType.CLIENT_PROOF, os.urandom(64))),
        "bad_hello",
    ),
    # message 3
    (
        "garbage message 3",
        after_message_2(lambda _: pack_envelope(HandshakeType.CLIENT_PROOF, os.urandom(64))),
        "bad_proof",
    ),
    (
        "empty message 3",
        after_message_2(lambda _: pack_envelope(HandshakeType.CLIENT_PROOF)),
        "bad_proof",
    ),
    ("garbage bytes for message 3", after_message_2(lambda _: os.urandom(64)), "bad_magic"),
    (
        "message 3 cut short",
        after_message_2(
            lambda _: pack_envelope(HandshakeType.CLIENT_PROOF, os.urandom(64))[:30],
            then_eof=True,
        ),
        "closed",
    ),
    (
        "message 1 again instead of message 3",
        after_message_2(lambda _: message_1(noise_client())),
        "bad_hello",
    ),
    (
        "a malformed abort",
        after_message_2(lambda _: pack_envelope(HandshakeType.CLIENT_ABORT, b"\x09\x09")),
        "bad_hello",
    ),
]


async def held_channel(listener: Listener, node: str) -> tuple[Transport, SecureChannel]:
    transport = create_transport("tcp", config(node))
    return transport, await transport.connect(*listener.address)


async def still_works(channel: SecureChannel) -> None:
    await channel.send(MessageKind.CONTROL, {"still": "here"})
    assert (await channel.recv()).meta == {"still": "here"}


@pytest.mark.parametrize(
    ("attack", "reason"), [a[1:] for a in CLIENT_ATTACKS], ids=[a[0] for a in CLIENT_ATTACKS]
)
def test_a_hostile_client_is_refused_at_each_step_and_only_its_connection_ends(
    attack: Attack, reason: str
) -> None:
    async def scenario() -> None:
        server = create_transport("tcp", config("server"))
        async with await serve(server) as listener:
            _, held = await held_channel(listener, "stage-0")
            reader, writer = await asyncio.open_connection(*listener.address)
            await attack(reader, writer)
            answer = await until_closed(reader)  # the listener hangs up on the attacker
            writer.close()
            if reason == "bad_proof":  # past message 2, the server closes without a verdict
                assert answer == b""
            await eventually(lambda: bool(server.stats.handshake_failures))
            assert dict(server.stats.handshake_failures) == {reason: 1}
            assert not server.stats.verdicts_sent.get("refused")
            await still_works(held)
            await assert_serving(listener)
            await held.close()

    run(scenario)


# -- a fake server ---------------------------------------------------------------------------

#: what a fake server answers to a client's message 1 (its bytes, then it closes)
FakeAnswer = Callable[[bytes], bytes]


def _real_message_2(body: bytes) -> bytes:
    """An honest server's message 2 to ``body`` (the real key of node "server")."""
    noise = NoiseHandshake(
        initiator=False,
        static=node_key_for("server"),
        psk=psk_from_secret(SECRET.key_bytes()),
        prologue=prologue(),
    )
    noise.read_message_1(body)
    return noise.write_message_2(encode_hello(Hello(0, CLUSTER, "server")))


SERVER_ATTACKS: list[tuple[str, FakeAnswer, str]] = [
    ("garbage instead of message 2", lambda _: os.urandom(64), "bad_magic"),
    (
        "message 2 beyond the body bound",
        lambda _: struct.pack(">4sHBBH", MAGIC, PROTOCOL_VERSION, 2, 0, MAX_BODY + 1),
        "bad_hello",
    ),
    (
        "garbage Noise message 2",
        lambda _: pack_envelope(HandshakeType.SERVER_HELLO, os.urandom(120)),
        "bad_hello",
    ),
    (
        "message 2 cut short",
        lambda body: pack_envelope(HandshakeType.SERVER_HELLO, _real_message_2(body))[:60],
        "closed",
    ),
    (
        "message 2 with its last byte altered",
        lambda body: flip_bit(pack_envelope(HandshakeType.SERVER_HELLO, _real_message_2(body)), -1),
        "bad_hello",
    ),
    (
        "message 2 under another type",
        lambda body: pack_envelope(HandshakeType.CLIENT_HELLO, _real_message_2(body)),
        "bad_hello",
    ),
    (
        "a record instead of message 2",
        lambda _: struct.pack(">BBHI", 1, 0, 0, 19) + os.urandom(19),
        "bad_magic",
    ),
]


@pytest.mark.parametrize(
    ("answer", "reason"), [a[1:] for a in SERVER_ATTACKS], ids=[a[0] for a in SERVER_ATTACKS]
)
def test_a_client_refuses_a_fake_servers_answer_and_keeps_its_other_channels(
    answer: FakeAnswer, reason: str
) -> None:
    async def fake_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            _, body = await read_message(reader)
            writer.write(answer(body))
            await writer.drain()
        writer.close()

    async def scenario() -> None:
        real = create_transport("tcp", config("server"))
        async with await serve(real) as listener:
            client, held = await held_channel(listener, "client")
            fake = await asyncio.start_server(fake_server, "127.0.0.1", 0)
            async with fake:
                with pytest.raises(HandshakeError) as error:
                    await client.connect(*fake.sockets[0].getsockname()[:2])
            assert error.value.reason == reason
            assert dict(client.stats.handshake_failures) == {reason: 1}
            await still_works(held)
            await held.close()

    run(scenario)


def _flip_verdict(index: int, record: bytes) -> list[bytes | Cut]:
    return [flip_bit(record, 8)] if index == 0 else [record]


def _garbage_verdict(index: int, record: bytes) -> list[bytes | Cut]:
    return [record[:8] + os.urandom(len(record) - 8)] if index == 0 else [record]


def _retyped_verdict(index: int, record: bytes) -> list[bytes | Cut]:
    # The same ciphertext under the MESSAGE type: the header is associated data.
    return [bytes([2]) + record[1:]] if index == 0 else [record]


def _verdict_cut(index: int, record: bytes) -> list[bytes | Cut]:
    return [record[:12], CUT]


@pytest.mark.parametrize(
    ("tamper", "frame_reason"),
    [
        (_flip_verdict, "bad_tag"),
        (_garbage_verdict, "bad_tag"),
        (_retyped_verdict, "bad_tag"),
        (_verdict_cut, "truncated"),
    ],
    ids=["a bit flipped", "replaced by noise", "retyped", "cut short"],
)
def test_an_altered_verdict_is_refused_by_the_client_and_counted_twice(
    tamper: Callable[[int, bytes], list[bytes | Cut]], frame_reason: str
) -> None:
    """The verdict is record 0 under the session key: a path attacker cannot turn it into
    another one, only break the connection (a rejected frame and a failed handshake)."""

    async def scenario() -> None:
        server = create_transport("tcp", config("server"))
        async with await serve(server) as listener:
            client, held = await held_channel(listener, "client")
            async with TamperProxy(listener.address, s2c=tamper) as proxy:
                with pytest.raises(HandshakeError) as error:
                    await client.connect(*proxy.address)
            assert error.value.reason == "bad_verdict"
            assert error.value.frame_error is not None
            assert error.value.frame_error.reason == frame_reason
            assert dict(client.stats.handshake_failures) == {"bad_verdict": 1}
            assert dict(client.stats.rejected_frames) == {frame_reason: 1}
            await still_works(held)
            await held.close()

    run(scenario)
