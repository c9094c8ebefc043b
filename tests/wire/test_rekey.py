"""Rekeying on real loopback sockets: a channel replaces its sending key every
``RekeyPolicy.after_records`` records or ``after_s`` seconds, and nothing else changes.

Every message still arrives intact and in order (small ones sealed in one call, ones over 64 KiB
streamed), both ends follow each other's key epochs, the ratchet is the documented one-way HKDF,
and a REKEY record that breaks the rules closes its connection and is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SMALL_RECORD_BYTES, RekeyPolicy, SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import ChannelClosedError, HandshakeError
from mlxppd.wire.handshake import (
    ENVELOPE,
    HandshakeType,
    Hello,
    encode_hello,
    pack_envelope,
    prologue,
    psk_from_secret,
)
from mlxppd.wire.noise import NoiseHandshake
from mlxppd.wire.record import RecordSealer, RecordType
from mlxppd.wire.transport import Transport
from tests.support.node_keys import node_key_for
from tests.support.wire import (
    CLUSTER,
    SECRET,
    KnownEphemerals,
    Recording,
    RecordingProxy,
    assert_serving,
    config,
    eventually,
    opens,
    run,
    serve,
    session_keys,
)

pytestmark = pytest.mark.timeout(120)

BACKENDS = ["tcp", "rdma"]
#: a tensor large enough to be streamed in pieces (> SMALL_RECORD_BYTES)
LARGE = np.arange(48 * 1024, dtype=np.float32).reshape(3, 16 * 1024)
assert LARGE.nbytes > SMALL_RECORD_BYTES


class Echoes:
    """An echo handler that also keeps the server's end of each channel, to read its epochs."""

    def __init__(self) -> None:
        self.channels: list[SecureChannel] = []

    async def __call__(self, channel: SecureChannel) -> None:
        self.channels.append(channel)
        async for message in channel:
            await channel.send(MessageKind.REPLY, message.meta, message.tensor)


def tensor_for(n: int) -> np.ndarray | None:
    if n % 7 == 3:
        return LARGE + n  # streamed, each one different
    if n % 3 == 1:
        return np.full((1, 1, 64), n, dtype=np.float16)  # a decode step's activation
    return None  # a bare control message


def pair(backend: str, policy: RekeyPolicy) -> tuple[Transport, Transport]:
    return (
        create_transport(backend, config("server", rekey=policy)),
        create_transport(backend, config("client", rekey=policy)),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_a_short_key_life_every_message_arrives_intact_in_order_under_ever_new_keys(
    backend: str,
) -> None:
    async def scenario() -> None:
        server, client = pair(backend, RekeyPolicy(after_records=3))
        handler = Echoes()
        async with await serve(server, handler) as listener:
            channel = await client.connect(*listener.address)
            fingerprints = [channel.key_fingerprints()]
            for n in range(60):
                sent = tensor_for(n)
                await channel.send(MessageKind.CONTROL, {"n": n}, sent)
                reply = await channel.recv()
                assert reply.meta == {"n": n}
                if sent is None:
                    assert reply.tensor is None
                else:
                    assert reply.tensor is not None and reply.tensor.shape == sent.shape
                    got = np.frombuffer(reply.tensor.data, dtype=reply.tensor.dtype.storage_name)
                    assert np.array_equal(got.reshape(sent.shape), sent)
                fingerprints.append(channel.key_fingerprints())
            theirs = handler.channels[0]
            sending, receiving = channel.key_epochs
            assert sending >= 60 // 3 - 1 and receiving >= 60 // 3 - 1
            assert theirs.key_epochs == (receiving, sending)  # the two ends agree
            assert theirs.key_fingerprints() == channel.key_fingerprints()[::-1]
            # One fingerprint per epoch, each new key different from every earlier one.
            assert len({f for f, _ in fingerprints}) == sending + 1
            assert len({f for _, f in fingerprints}) == receiving + 1
            assert (client.stats.rekeys_sent, client.stats.rekeys_received) == (sending, receiving)
            assert (server.stats.rekeys_sent, server.stats.rekeys_received) == (receiving, sending)
            assert not client.stats.rejected_frames and not server.stats.rejected_frames
            await channel.close()

    run(scenario)


def test_concurrent_senders_keep_their_order_across_rekeys() -> None:
    """Three tasks send at once: the REKEY records fall between whole messages, never inside
    another sender's record, and each sender's messages arrive in its order."""

    async def scenario() -> None:
        server, client = pair("tcp", RekeyPolicy(after_records=2))
        got: list[tuple[int, int]] = []
        done = asyncio.Event()

        async def collect(channel: SecureChannel) -> None:
            async for message in channel:
                got.append((message.meta["task"], message.meta["i"]))
                if len(got) == 90:
                    done.set()

        async with await serve(server, collect) as listener:
            channel = await client.connect(*listener.address)

            async def sender(task: int) -> None:
                for i in range(30):
                    tensor = LARGE if i % 10 == 5 else None
                    await channel.send(MessageKind.CONTROL, {"task": task, "i": i}, tensor)

            await asyncio.gather(*(sender(t) for t in range(3)))
            await asyncio.wait_for(done.wait(), 60)
            for task in range(3):
                assert [i for t, i in got if t == task] == list(range(30))
            assert channel.key_epochs[0] == client.stats.rekeys_sent >= 90 // 2 - 1
            assert server.stats.rekeys_received == client.stats.rekeys_sent
            await channel.close()

    run(scenario)


def test_a_key_is_replaced_once_its_time_is_up_on_an_injected_clock() -> None:
    now = [1000.0]
    policy = RekeyPolicy(after_s=120.0, clock=lambda: now[0])

    async def scenario() -> None:
        server, client = pair("tcp", policy)
        handler = Echoes()
        async with await serve(server, handler) as listener:
            channel = await client.connect(*listener.address)

            async def exchange(n: int) -> None:
                await channel.send(MessageKind.CONTROL, {"n": n})
                assert (await channel.recv()).meta == {"n": n}

            await exchange(0)
            now[0] += 119.0
            await exchange(1)
            assert channel.key_epochs == (0, 0)
            before = channel.key_fingerprints()
            now[0] += 1.0  # 120 s since the handshake: both directions' keys are due
            await exchange(2)
            assert channel.key_epochs == (1, 1) == handler.channels[0].key_epochs
            assert channel.key_fingerprints()[0] != before[0]
            assert channel.key_fingerprints()[1] != before[1]
            await exchange(3)  # a fresh key has a fresh deadline
            assert channel.key_epochs == (1, 1)
            now[0] += 120.0
            await exchange(4)
            assert channel.key_epochs == (2, 2)
            assert (client.stats.rekeys_sent, server.stats.rekeys_received) == (2, 2)
            await channel.close()

    run(scenario)


def test_the_defaults_are_2_to_the_24_records_and_120_seconds() -> None:
    assert (RekeyPolicy().after_records, RekeyPolicy().after_s) == (2**24, 120.0)
    for bad in ({"after_records": 0}, {"after_s": 0.0}, {"after_s": float("nan")}):
        with pytest.raises(ValueError):
            RekeyPolicy(**bad)  # type: ignore[arg-type]


# -- the ratchet -----------------------------------------------------------------------------


def _ratchet_by_the_doc(key: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt=None, info=b"mlxpp/2 rekey").derive(key)


def test_the_ratchet_is_the_documented_hkdf_and_a_later_key_opens_no_earlier_record() -> None:
    """A recording with the ephemerals known (as in the forward-secrecy control): every record
    opens under the key the doc says, REKEY records are empty and end their key's records, and
    the key a channel holds at the end (what a memory dump would give) opens none before it."""
    e_client, e_server = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    policy = RekeyPolicy(after_records=2)
    recorded: list[Recording] = []
    final_key: list[bytes] = []

    async def scenario() -> None:
        server = KnownEphemerals(config("server", rekey=policy), [e_server])
        client = KnownEphemerals(config("client", rekey=policy), [e_client])
        async with await serve(server, Echoes()) as listener:
            async with RecordingProxy(listener.address) as proxy:
                channel = await client.connect(*proxy.address)
                for n in range(7):
                    await channel.send(MessageKind.CONTROL, {"n": n})
                    await channel.recv()
                # What someone who seizes the process now could read out of its memory.
                final_key.append(channel._sealer._key)  # type: ignore[attr-defined]
                await channel.close()
                await eventually(lambda: proxy.finished == 1)
                got = proxy.recorded[0]
                recorded.append(Recording.parse(bytes(got["c2s"]), bytes(got["s2c"])))

    run(scenario)
    rec = recorded[0]
    ee = e_client.exchange(X25519PublicKey.from_public_bytes(rec.message_2[:32]))
    es = node_key_for("server").exchange(rec.message_1[:32])
    se = node_key_for("client").exchange(rec.message_2[:32])
    key, _ = session_keys(rec, ee, es, se, psk_from_secret(SECRET.key_bytes()))
    # Client to server: m, m, REKEY, m, m, REKEY, ... then the goodbye.
    types = [header[0] for header, _ in rec.c2s]
    assert types[:3] == [RecordType.MESSAGE, RecordType.MESSAGE, RecordType.REKEY]
    keys = []
    for sequence, (header, _) in enumerate(rec.c2s):
        keys.append(key)
        assert opens(key, rec.c2s[sequence : sequence + 1], sequence) is not None
        if header[0] == RecordType.REKEY:
            assert opens(key, rec.c2s[sequence : sequence + 1], sequence) == [b""]
            key = _ratchet_by_the_doc(key)
    assert key == final_key[0]
    earlier = [i for i, k in enumerate(keys) if k != final_key[0]]
    assert len(earlier) >= 6
    for i in earlier:
        assert opens(final_key[0], rec.c2s[i : i + 1], i) is None


# -- REKEY records that break the rules ------------------------------------------------------


def test_a_rekey_record_with_a_body_is_rejected_counted_and_closes_its_connection() -> None:
    async def scenario() -> None:
        server = create_transport("tcp", config("server"))
        client = create_transport("tcp", config("client"))
        async with await serve(server, Echoes()) as listener:
            channel = await client.connect(*listener.address)
            # Only a peer holding the session key can seal one: a node that breaks the rules.
            forged = channel._sealer.seal(RecordType.REKEY, [b"\x00"])  # type: ignore[attr-defined]
            await channel._stream.write((forged,))  # type: ignore[attr-defined]
            with pytest.raises(ChannelClosedError) as closed:
                await asyncio.wait_for(channel.recv(), 30)
            assert not closed.value.clean
            await eventually(lambda: bool(server.stats.rejected_frames))
            assert dict(server.stats.rejected_frames) == {"bad_header": 1}
            assert server.stats.rekeys_received == 0
            await assert_serving(listener)

    run(scenario)


async def _rekey_instead_of_a_verdict(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """A server holding the real key and secret that sends REKEY as its record 0."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        noise = NoiseHandshake(
            initiator=False,
            static=node_key_for("server"),
            psk=psk_from_secret(SECRET.key_bytes()),
            prologue=prologue(),
        )
        for expected in (HandshakeType.CLIENT_HELLO, HandshakeType.CLIENT_PROOF):
            envelope = await reader.readexactly(ENVELOPE.size)
            assert envelope[6] == expected
            body = await reader.readexactly(struct.unpack_from(">H", envelope, 8)[0])
            if expected is HandshakeType.CLIENT_HELLO:
                noise.read_message_1(body)
                hello = encode_hello(Hello(0, CLUSTER, "server"))
                writer.write(
                    pack_envelope(HandshakeType.SERVER_HELLO, noise.write_message_2(hello))
                )
            else:
                noise.read_message_3(body)
        _, to_client = noise.split()
        writer.write(RecordSealer(to_client).seal(RecordType.REKEY, ()))
        await writer.drain()
        await reader.read()
    writer.close()


def test_a_rekey_record_in_place_of_the_verdict_fails_the_handshake() -> None:
    async def scenario() -> None:
        fake = await asyncio.start_server(_rekey_instead_of_a_verdict, "127.0.0.1", 0)
        client = create_transport("tcp", config("client"))
        async with fake:
            with pytest.raises(HandshakeError) as error:
                await client.connect(*fake.sockets[0].getsockname()[:2])
        assert error.value.reason == "bad_verdict"
        assert error.value.frame_error is not None
        assert error.value.frame_error.reason == "unexpected_record"
        assert dict(client.stats.handshake_failures) == {"bad_verdict": 1}
        assert dict(client.stats.rejected_frames) == {"unexpected_record": 1}

    run(scenario)
