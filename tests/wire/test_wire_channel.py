"""Secure channels between real sockets on 127.0.0.1: who gets in, and what comes through.

Every refusal closes that connection, is counted on the side that detected it, and leaves the
listener serving other peers.
"""

from __future__ import annotations

import asyncio
import logging
import struct

import numpy as np
import pytest

from mlxppd.core.errors import TemporaryError
from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Message, MessageKind
from mlxppd.wire.errors import (
    ChannelClosedError,
    HandshakeError,
    MessageEncodingError,
    PeerAtCapacityError,
    VersionMismatchError,
)
from mlxppd.wire.handshake import ENVELOPE, MAGIC, HandshakeType, pack_envelope
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.version import PROTOCOL_VERSION
from tests.support.node_keys import roster_for
from tests.support.wire import (
    OTHER_SECRET,
    SECRET_TEXT,
    assert_serving,
    config,
    eventually,
    run,
    serve,
)

pytestmark = pytest.mark.timeout(60)

BACKENDS = ["tcp", "rdma"]


# -- what comes through ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape", [(1, 1, 64), (1, 1, 4096), (1, 512, 4096)], ids=["rpc", "decode", "prefill"]
)
def test_activations_arrive_bit_exact_with_their_metadata(
    backend: str, shape: tuple[int, ...]
) -> None:
    array = np.random.default_rng(0).standard_normal(shape).astype(np.float16)

    async def scenario() -> None:
        server = create_transport(backend, config("server"))
        client = create_transport(backend, config("client"))
        async with await serve(server) as listener:
            channel = await client.connect(*listener.address, expected_peer="server")
            await channel.send(MessageKind.ACTIVATION, {"seq": 7, "batch": [1, 2]}, array)
            reply = await channel.recv()
            await channel.close()
        assert reply.meta == {"seq": 7, "batch": [1, 2]}
        assert reply.tensor is not None
        assert reply.tensor.dtype.name == "float16" and reply.tensor.shape == shape
        got = np.frombuffer(reply.tensor.data, dtype=reply.tensor.dtype.storage_name)
        assert np.array_equal(got.reshape(shape), array)
        assert not reply.tensor.data.readonly  # writable memory the engine may wrap

    run(scenario)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nbytes", [1024, 3 * 1024 * 1024], ids=["small", "streamed"])
def test_a_tensor_is_received_into_the_callers_buffer(backend: str, nbytes: int) -> None:
    data = np.arange(nbytes, dtype=np.uint8)
    buffer = bytearray(nbytes + 100)

    async def scenario() -> None:
        server = create_transport(backend, config("server"))
        client = create_transport(backend, config("client"))
        async with await serve(server) as listener:
            channel = await client.connect(*listener.address)
            await channel.send(MessageKind.ACTIVATION, {}, data)
            reply = await channel.recv(into=buffer)
            await channel.close()
        assert reply.tensor is not None
        assert bytes(buffer[:nbytes]) == data.tobytes()  # the bytes landed in our buffer
        assert np.shares_memory(
            np.frombuffer(reply.tensor.data, np.uint8), np.frombuffer(buffer, np.uint8)
        )

    run(scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_too_large_for_the_callers_buffer_owns_its_memory(backend: str) -> None:
    # Small records received ``into`` are decrypted in a scratch buffer the channel reuses;
    # a tensor that does not fit the caller's buffer must be a copy, never a view of it.
    sent = [np.full(4096, i, dtype=np.uint8) for i in range(1, 4)]
    small = bytearray(16)

    async def scenario() -> list[Message]:
        server = create_transport(backend, config("server"))
        client = create_transport(backend, config("client"))
        async with await serve(server) as listener:
            channel = await client.connect(*listener.address)
            for i, array in enumerate(sent):
                await channel.send(MessageKind.ACTIVATION, {"i": i}, array)
            replies = [await channel.recv(into=small) for _ in sent]
            await channel.close()
        return replies

    replies = run(scenario)
    assert [r.meta for r in replies] == [{"i": 0}, {"i": 1}, {"i": 2}]
    for reply, array in zip(replies, sent, strict=True):
        assert reply.tensor is not None
        assert bytes(reply.tensor.data) == array.tobytes()  # not overwritten by a later one
    assert small == bytearray(16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_senders_never_interleave_records(backend: str) -> None:
    async def scenario() -> None:
        server = create_transport(backend, config("server"))
        client = create_transport(backend, config("client"))
        async with await serve(server) as listener:
            channel = await client.connect(*listener.address)
            payloads = [np.full(200_000, i, dtype=np.int32) for i in range(8)]
            await asyncio.gather(
                *(channel.send(MessageKind.ACTIVATION, {"i": i}, p) for i, p in enumerate(payloads))
            )
            seen = set()
            for _ in payloads:
                reply = await channel.recv()
                assert reply.tensor is not None
                values = np.frombuffer(reply.tensor.data, dtype=np.int32)
                assert (values == reply.meta["i"]).all()
                seen.add(reply.meta["i"])
            await channel.close()
        assert seen == set(range(8))
        assert not server.stats.rejected_frames and not client.stats.rejected_frames

    run(scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_records_from_many_senders_stay_whole_when_the_socket_fills(backend: str) -> None:
    # Decode-step records go out without yielding when the kernel takes them whole; when it
    # does not, the sender waits its turn and the next records queue behind it, in order.
    async def scenario() -> None:
        server = create_transport(backend, config("server"))
        client = create_transport(backend, config("client"))
        async with await serve(server) as listener:
            channel = await client.connect(*listener.address)
            count = 600
            payloads = [np.full(2048, i, dtype=np.int32) for i in range(count)]  # 8 KiB each
            seen: list[int] = []

            async def read_all() -> None:
                for _ in range(count):
                    reply = await channel.recv()
                    assert reply.tensor is not None
                    values = np.frombuffer(reply.tensor.data, dtype=np.int32)
                    assert (values == reply.meta["i"]).all()
                    seen.append(reply.meta["i"])

            reader = asyncio.create_task(read_all())
            await asyncio.gather(
                *(channel.send(MessageKind.ACTIVATION, {"i": i}, p) for i, p in enumerate(payloads))
            )
            await reader
            await channel.close()
        assert seen == list(range(count))  # the order the sends were started in
        assert not server.stats.rejected_frames and not client.stats.rejected_frames

    run(scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_says_goodbye_and_the_peer_sees_a_clean_end(backend: str) -> None:
    ended: list[str] = []

    async def handler(channel: SecureChannel) -> None:
        async for _ in channel:
            pass
        ended.append("clean")

    async def scenario() -> None:
        server = create_transport(backend, config("server"))
        client = create_transport(backend, config("client"))
        async with await serve(server, handler) as listener:
            channel = await client.connect(*listener.address)
            await channel.send(MessageKind.CONTROL, {"op": "noop"})
            await channel.close()
            with pytest.raises(ChannelClosedError):
                await channel.send(MessageKind.CONTROL)
            await eventually(lambda: ended == ["clean"] and listener.active == 0)
        assert not server.stats.rejected_frames

    run(scenario)


def test_a_message_over_the_frame_limit_is_refused_locally_and_the_channel_stays_usable() -> None:
    async def scenario() -> None:
        limits = FrameLimits(max_frame_bytes=4096)
        server = create_transport("tcp", config("server", limits=limits))
        client = create_transport("tcp", config("client", limits=limits))
        async with await serve(server) as listener:
            channel = await client.connect(*listener.address)
            with pytest.raises(MessageEncodingError, match="frame limit"):
                await channel.send(MessageKind.ACTIVATION, {}, np.zeros(8192, np.uint8))
            await channel.send(MessageKind.CONTROL, {"still": "open"})
            assert (await channel.recv()).meta == {"still": "open"}
            await channel.close()

    run(scenario)


# -- who gets in -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wrong_secret_is_refused_by_the_server_and_the_client_learns_only_that(
    backend: str,
) -> None:
    """A listed node with the wrong secret: its third message fails the PSK, and the server
    closes without a verdict, so the client cannot tell which factor it lacks."""

    async def scenario() -> None:
        server = create_transport(backend, config("server"))
        intruder = create_transport(backend, config("client", secret=OTHER_SECRET))
        async with await serve(server) as listener:
            with pytest.raises(HandshakeError, match="closed the connection instead of answering"):
                await intruder.connect(*listener.address)
            await eventually(lambda: bool(server.stats.handshake_failures))
            assert dict(intruder.stats.handshake_failures) == {"peer_rejected_proof": 1}
            assert dict(server.stats.handshake_failures) == {"bad_proof": 1}
            assert not server.stats.verdicts_sent
            await assert_serving(listener, backend)

    run(scenario)


def test_a_client_of_another_cluster_is_refused_by_both_sides() -> None:
    async def scenario() -> None:
        server = create_transport("tcp", config("server"))
        stranger = create_transport("tcp", config("stranger", cluster_name="other-cluster"))
        async with await serve(server) as listener:
            with pytest.raises(HandshakeError, match="cluster 'test-cluster'"):
                await stranger.connect(*listener.address)
            await eventually(lambda: bool(server.stats.handshake_failures))
            assert dict(stranger.stats.handshake_failures) == {"cluster_mismatch": 1}
            assert dict(server.stats.handshake_failures) == {"cluster_mismatch": 1}
            await assert_serving(listener)

    run(scenario)


def test_a_client_refuses_a_server_that_is_not_the_node_it_dialed() -> None:
    async def scenario() -> None:
        server = create_transport("tcp", config("stage-1"))
        client = create_transport("tcp", config("client"))
        async with await serve(server) as listener:
            with pytest.raises(HandshakeError, match="meant to reach node 'stage-2'"):
                await client.connect(*listener.address, expected_peer="stage-2")
            await eventually(lambda: bool(server.stats.handshake_failures))
            assert dict(client.stats.handshake_failures) == {"unexpected_peer": 1}
            assert dict(server.stats.handshake_failures) == {"unexpected_peer": 1}

    run(scenario)


def test_a_node_the_roster_does_not_list_gets_the_refusal_a_wrong_secret_gets() -> None:
    async def scenario() -> None:
        roster = RosterBook(roster_for(["server", "stage-1"]))
        server = create_transport("tcp", config("server", roster=roster))
        async with await serve(server) as listener:
            outsider = create_transport("tcp", config("stage-9"))  # right secret, own key
            with pytest.raises(HandshakeError, match="closed the connection instead of answering"):
                await outsider.connect(*listener.address)
            await eventually(lambda: bool(server.stats.handshake_failures))
            assert dict(outsider.stats.handshake_failures) == {"peer_rejected_proof": 1}
            assert dict(server.stats.handshake_failures) == {"bad_proof": 1}
            assert not server.stats.verdicts_sent  # no authenticated refusal: nothing to probe
            member = create_transport("tcp", config("stage-1"))
            channel = await member.connect(*listener.address)
            await channel.close()

    run(scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_listener_answers_at_capacity_until_a_slot_frees(backend: str) -> None:
    async def scenario() -> None:
        server = create_transport(backend, config("server", max_connections=1))
        client = create_transport(backend, config("client"))
        async with await serve(server) as listener:
            first = await client.connect(*listener.address)
            with pytest.raises(PeerAtCapacityError, match="at capacity") as error:
                await client.connect(*listener.address)
            assert isinstance(error.value, TemporaryError)  # worth retrying
            await first.close()
            await eventually(lambda: listener.active == 0)
            second = await client.connect(*listener.address)
            await second.close()
        assert dict(server.stats.verdicts_sent) == {"accepted": 2, "at_capacity": 1}
        assert not client.stats.handshake_failures  # a verdict, not a failure

    run(scenario)


@pytest.mark.parametrize("other", [1, PROTOCOL_VERSION + 1], ids=["protocol 1", "a later one"])
def test_a_version_mismatch_is_refused_naming_both_versions(
    other: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A node of another protocol version dials us (one not yet upgraded from protocol 1, or
    one already newer): we answer with our version and both refuse."""
    caplog.set_level(logging.WARNING, logger="mlxppd.wire")
    future = other

    async def scenario() -> None:
        server = create_transport("tcp", config("server"))
        async with await serve(server) as listener:
            reader, writer = await asyncio.open_connection(*listener.address)
            # Another version's hello: only its envelope is ours to read.
            writer.write(pack_envelope(HandshakeType.CLIENT_HELLO, b"\x00" * 80, version=future))
            answer = await reader.readexactly(ENVELOPE.size)
            assert await reader.read() == b""  # then the listener hung up
            writer.close()
            magic, version, htype, _, body_len = ENVELOPE.unpack(answer)
            assert (magic, version, htype, body_len) == (
                MAGIC,
                PROTOCOL_VERSION,
                HandshakeType.VERSION_REFUSED,
                0,
            )
            await eventually(lambda: bool(server.stats.handshake_failures))
            assert dict(server.stats.handshake_failures) == {"version_mismatch": 1}
            await assert_serving(listener)

    run(scenario)
    message = next(r.getMessage() for r in caplog.records if "version_mismatch" in r.getMessage())
    assert f"version {future}" in message and f"version {PROTOCOL_VERSION}" in message


def test_a_client_names_both_versions_when_the_server_speaks_another() -> None:
    future = PROTOCOL_VERSION + 1

    async def old_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(ENVELOPE.size)
        writer.write(pack_envelope(HandshakeType.VERSION_REFUSED, version=future))
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(old_server, "127.0.0.1", 0)
        client = create_transport("tcp", config("client"))
        async with server:
            with pytest.raises(VersionMismatchError) as error:
                await client.connect(*server.sockets[0].getsockname()[:2])
        assert error.value.peer_version == future
        assert f"version {future}" in str(error.value)
        assert f"version {PROTOCOL_VERSION}" in str(error.value)
        assert dict(client.stats.handshake_failures) == {"version_mismatch": 1}

    run(scenario)


@pytest.mark.parametrize(
    ("greeting", "reason"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad_magic"),
        (struct.pack(">4sHBBH", MAGIC, PROTOCOL_VERSION, 1, 0, 60_000), "bad_hello"),
        (pack_envelope(HandshakeType.CLIENT_HELLO, b"\x01\x02"), "bad_hello"),
        (b"", "timeout"),
        (b"MXPP", "closed"),
    ],
    ids=["not mlxpp", "oversized body", "malformed hello", "silent", "cut short"],
)
def test_garbage_before_the_handshake_is_dropped_and_counted(greeting: bytes, reason: str) -> None:
    async def scenario() -> None:
        # Short only where the timeout is the point, so a busy machine cannot turn a quick
        # rejection into a timeout.
        timeout = 0.3 if reason == "timeout" else 60.0
        server = create_transport("tcp", config("server", handshake_timeout_s=timeout))
        async with await serve(server) as listener:
            reader, writer = await asyncio.open_connection(*listener.address)
            writer.write(greeting)
            if reason == "closed":
                writer.write_eof()
            await writer.drain()
            await asyncio.wait_for(reader.read(), 60)  # the listener hangs up on us
            writer.close()
            await eventually(lambda: bool(server.stats.handshake_failures))
            assert dict(server.stats.handshake_failures) == {reason: 1}
            await assert_serving(listener)

    run(scenario)


def test_connecting_to_nothing_is_a_temporary_error() -> None:
    async def scenario() -> None:
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        with pytest.raises(TemporaryError, match="cannot connect"):
            await create_transport("tcp", config("client")).connect("127.0.0.1", port)

    run(scenario)


def test_the_secret_never_reaches_the_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def scenario() -> None:
        server = create_transport("tcp", config("server"))
        async with await serve(server) as listener:
            for secret in (OTHER_SECRET, None):
                overrides = {"secret": secret} if secret else {}
                client = create_transport("tcp", config("client", **overrides))
                try:
                    channel = await client.connect(*listener.address)
                    await channel.send(MessageKind.CONTROL, {"x": 1})
                    await channel.recv()
                    await channel.close()
                except HandshakeError as exc:
                    logging.getLogger("test").warning("refused: %s (%r)", exc, exc)

    run(scenario)
    assert "refused" in caplog.text
    for leak in (SECRET_TEXT, OTHER_SECRET.key_bytes().decode(), repr(OTHER_SECRET.key_bytes())):
        assert leak not in caplog.text


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_a_channel_ends_a_waiting_receive_cleanly(backend: str) -> None:
    async def idle(channel: SecureChannel) -> None:
        await asyncio.sleep(30)

    async def scenario() -> None:
        server = create_transport(backend, config("server"))
        client = create_transport(backend, config("client"))
        async with await serve(server, idle) as listener:
            channel = await client.connect(*listener.address)
            waiting = asyncio.create_task(channel.recv())
            await asyncio.sleep(0.05)
            await channel.close()
            with pytest.raises(ChannelClosedError) as closed:
                await waiting
            assert closed.value.clean
        assert not client.stats.rejected_frames

    run(scenario)
