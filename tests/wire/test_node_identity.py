"""Per-node keys on real loopback sockets: a host is only the node whose key it holds, a refusal
says nothing about which factor was missing, a roster change takes effect on open channels at
once, and a recorded session stays sealed even for someone who later holds every long-term key.
"""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from mlxppd.core.config.roster import Roster
from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind, decode_message
from mlxppd.wire.errors import ChannelClosedError, HandshakeError
from mlxppd.wire.handshake import ENVELOPE, HandshakeType, Hello, prologue, psk_from_secret
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.noise import NoiseError, NoiseHandshake
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.streams import ByteStream
from mlxppd.wire.tcp import TcpTransport
from mlxppd.wire.transport import WireConfig
from tests.support.node_keys import node_key_for, roster_for
from tests.support.wire import (
    OTHER_SECRET,
    ROSTER,
    SECRET,
    KnownEphemerals,
    Recording,
    RecordingProxy,
    assert_serving,
    config,
    echo,
    eventually,
    opens,
    run,
    serve,
    session_keys,
)

pytestmark = pytest.mark.timeout(60)


async def still_works(channel: SecureChannel, n: int = 1) -> None:
    await channel.send(MessageKind.CONTROL, {"n": n})
    assert (await channel.recv()).meta == {"n": n}


# -- a host is only the node whose key it holds ----------------------------------------------


@pytest.mark.parametrize(
    "impostor",
    [
        {"node_key": NodeKey.generate("impostor")},  # a fresh key, claiming stage-1
        {"node_key": node_key_for("stage-0")},  # stage-0's host, claiming stage-1
    ],
    ids=["a key of its own", "another listed node's key"],
)
def test_a_client_claiming_another_nodes_id_is_refused_and_counted(
    impostor: dict[str, NodeKey],
) -> None:
    async def scenario() -> None:
        server = create_transport("tcp", config("server"))
        async with await serve(server) as listener:
            client = create_transport("tcp", config("stage-1", **impostor))
            with pytest.raises(HandshakeError) as error:
                await client.connect(*listener.address)
            assert error.value.reason == "peer_rejected_proof"
            await eventually(lambda: bool(server.stats.handshake_failures))
            assert dict(server.stats.handshake_failures) == {"bad_proof": 1}
            assert not server.stats.verdicts_sent and server.stats.channels_established == 0
            genuine = create_transport("tcp", config("stage-1"))
            channel = await genuine.connect(*listener.address)
            await still_works(channel)
            await channel.close()

    run(scenario)


def test_a_server_claiming_another_nodes_id_is_refused_by_the_client_and_told_why() -> None:
    async def scenario() -> None:
        impostor = create_transport("tcp", config("server", node_key=NodeKey.generate()))
        async with await serve(impostor) as listener:
            client = create_transport("tcp", config("client"))
            with pytest.raises(HandshakeError, match="proved the node key") as error:
                await client.connect(*listener.address, expected_peer="server")
            assert error.value.reason == "wrong_node_key"
            assert dict(client.stats.handshake_failures) == {"wrong_node_key": 1}
            await eventually(lambda: bool(impostor.stats.handshake_failures))
            # The client's abort: the impostor learns it was not believed, nothing more.
            assert dict(impostor.stats.handshake_failures) == {"peer_rejected_proof": 1}

    run(scenario)


# -- one refusal for every missing factor ----------------------------------------------------


REFUSED_CLIENTS: dict[str, dict[str, object]] = {
    "a wrong secret": {"node_id": "client", "secret": OTHER_SECRET},
    "an unknown key": {"node_id": "client", "node_key": NodeKey.generate("unknown")},
    "an unlisted id": {"node_id": "stranger"},
}


def _envelopes(data: bytes) -> list[tuple[int, int]]:
    """(type, body length) of each handshake envelope in ``data``; no bytes may be left."""
    found, at = [], 0
    while at < len(data):
        _, _, htype, _, body_len = ENVELOPE.unpack_from(data, at)
        found.append((htype, body_len))
        at += ENVELOPE.size + body_len
    assert at == len(data), "bytes after the last envelope"
    return found


def test_a_wrong_secret_an_unknown_key_and_an_unlisted_id_are_refused_identically(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Same server reason, same client error and reason, the same bytes from the server
    before it closes (its message 2 and no verdict), the same log line: no oracle."""
    caplog.set_level(logging.WARNING, logger="mlxppd.wire")
    outcomes: dict[str, tuple[type, str, tuple[tuple[int, int], ...]]] = {}
    server_reasons: dict[str, dict[str, int]] = {}

    async def refused(case: str, overrides: dict[str, object]) -> None:
        # A fresh listener for each: its first failure is logged in full (later ones are
        # throttled), so the three log lines can be compared too.
        server = create_transport("tcp", config("server"))
        async with await serve(server) as listener, RecordingProxy(listener.address) as proxy:
            settings = dict(overrides)
            client = create_transport("tcp", config(str(settings.pop("node_id")), **settings))
            with pytest.raises(HandshakeError) as error:
                await client.connect(*proxy.address)
            await eventually(lambda: bool(server.stats.handshake_failures))
            server_reasons[case] = dict(server.stats.handshake_failures)
            await eventually(lambda: proxy.finished == 1)
            s2c = bytes(proxy.recorded[0]["s2c"])
            outcomes[case] = (type(error.value), error.value.reason, tuple(_envelopes(s2c)))
            await assert_serving(listener)

    async def scenario() -> None:
        for case, overrides in REFUSED_CLIENTS.items():
            await refused(case, overrides)

    run(scenario)
    assert len(set(outcomes.values())) == 1, outcomes
    error_type, reason, sent = outcomes["a wrong secret"]
    assert (error_type, reason) == (HandshakeError, "peer_rejected_proof")
    assert [htype for htype, _ in sent] == [HandshakeType.SERVER_HELLO]  # and no verdict
    assert all(r == {"bad_proof": 1} for r in server_reasons.values()), server_reasons
    lines = [
        re.sub(r"127\.0\.0\.1:\d+|node '[^']*'", "<peer>", r.getMessage())
        for r in caplog.records
        if "bad_proof" in r.getMessage()
    ]
    assert len(lines) == 3 and len(set(lines)) == 1, lines


# -- a roster change reaches the open channels -----------------------------------------------


def test_removing_a_node_from_the_roster_closes_its_channels_at_once_and_only_its() -> None:
    async def scenario() -> None:
        book = RosterBook(ROSTER)
        server = create_transport("tcp", config("server", roster=book))
        async with await serve(server) as listener:
            leaving = await create_transport("tcp", config("stage-1")).connect(*listener.address)
            staying = await create_transport("tcp", config("stage-0")).connect(*listener.address)
            await still_works(leaving)
            await still_works(staying)
            waiting = asyncio.create_task(leaving.recv())
            remaining = dict(ROSTER.entries)
            del remaining["stage-1"]
            book.update(roster_for(remaining))
            with pytest.raises(ChannelClosedError) as closed:
                await asyncio.wait_for(waiting, 5)  # at once, not at the next message
            assert not closed.value.clean  # no goodbye: the peer is no longer trusted
            assert server.stats.revoked_channels == 1
            await still_works(staying, 2)
            again = create_transport("tcp", config("stage-1"))
            with pytest.raises(HandshakeError) as error:
                await again.connect(*listener.address)
            assert error.value.reason == "peer_rejected_proof"
            await eventually(lambda: server.stats.handshake_failures["bad_proof"] == 1)
            await still_works(staying, 3)
            await staying.close()
            await eventually(lambda: listener.active == 0)

    run(scenario)


def test_a_node_given_a_new_key_in_the_roster_loses_the_channels_of_its_old_key() -> None:
    async def scenario() -> None:
        book = RosterBook(ROSTER)
        server = create_transport("tcp", config("server", roster=book))
        new_key = NodeKey.generate("stage-1's new key")
        async with await serve(server) as listener:
            old = await create_transport("tcp", config("stage-1")).connect(*listener.address)
            book.update(Roster.of({**dict(ROSTER.entries), "stage-1": new_key.public}))
            with pytest.raises(ChannelClosedError):
                await asyncio.wait_for(old.recv(), 5)
            assert server.stats.revoked_channels == 1
            renewed = create_transport("tcp", config("stage-1", node_key=new_key))
            channel = await renewed.connect(*listener.address)
            await still_works(channel)
            book.update(book.current)  # the same roster again: nothing is closed
            await still_works(channel, 2)
            assert server.stats.revoked_channels == 1
            await channel.close()

    run(scenario)


class ReloadDuringHandshake(TcpTransport):
    """A listener whose roster is replaced (as by a reload of the TOML) after a handshake
    checked the old one and before its channel exists: the race a reload can land in."""

    def __init__(self, config: WireConfig, then: Roster):
        super().__init__(config)
        self._then = then

    async def _after_handshake(self, stream: ByteStream, peer: Hello) -> ByteStream:
        self.config.roster.update(self._then)
        return stream


def test_a_roster_change_during_a_handshake_still_reaches_its_channel() -> None:
    async def scenario() -> None:
        without = roster_for(n for n in ROSTER.node_ids() if n != "stage-1")
        server = ReloadDuringHandshake(config("server", roster=RosterBook(ROSTER)), without)
        async with await serve(server) as listener:
            channel = await create_transport("tcp", config("stage-1")).connect(*listener.address)
            with pytest.raises(ChannelClosedError):
                await asyncio.wait_for(channel.recv(), 5)
            assert server.stats.revoked_channels == 1

    run(scenario)


def test_a_client_whose_roster_drops_the_server_closes_its_channel_to_it() -> None:
    async def scenario() -> None:
        server = create_transport("tcp", config("server"))
        async with await serve(server) as listener:
            book = RosterBook(ROSTER)
            client = create_transport("tcp", config("client", roster=book))
            channel = await client.connect(*listener.address)
            await still_works(channel)
            remaining = dict(ROSTER.entries)
            del remaining["server"]
            book.update(roster_for(remaining))
            assert channel.closed and client.stats.revoked_channels == 1
            with pytest.raises(ChannelClosedError):
                await channel.recv()
            with pytest.raises(HandshakeError) as error:
                await client.connect(*listener.address)
            assert error.value.reason == "wrong_node_key"

    run(scenario)


# -- forward secrecy: a recording stays sealed -----------------------------------------------


def _dh(private: X25519PrivateKey | NodeKey, public: bytes) -> bytes:
    if isinstance(private, NodeKey):
        return private.exchange(public)
    return private.exchange(X25519PublicKey.from_public_bytes(public))


def _public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def record_a_session(
    client_keys: list[X25519PrivateKey] | None = None,
    server_keys: list[X25519PrivateKey] | None = None,
) -> Recording:
    """Messages both ways (a verdict, three requests and their replies, a goodbye) through a
    recording proxy; ``*_keys``: ephemerals to inject (None: the transports' own, random)."""
    got: list[Recording] = []

    async def scenario() -> None:
        def transport(node: str, keys: list[X25519PrivateKey] | None) -> TcpTransport:
            if keys is None:
                made = create_transport("tcp", config(node))
                assert isinstance(made, TcpTransport)
                return made
            return KnownEphemerals(config(node), keys)

        server = transport("server", server_keys)
        client = transport("client", client_keys)
        async with await serve(server, echo) as listener:
            async with RecordingProxy(listener.address) as proxy:
                channel = await client.connect(*proxy.address)
                for n in range(3):
                    await channel.send(MessageKind.CONTROL, {"secret plan": n})
                    assert (await channel.recv()).meta == {"secret plan": n}
                await channel.close()
                await eventually(lambda: proxy.finished == 1)
                recorded = proxy.recorded[0]
                got.append(Recording.parse(bytes(recorded["c2s"]), bytes(recorded["s2c"])))

    run(scenario)
    return got[0]


CLIENT_KEY, SERVER_KEY = node_key_for("client"), node_key_for("server")
PSK = psk_from_secret(SECRET.key_bytes())


def test_a_recorded_session_stays_sealed_for_whoever_later_holds_every_long_term_key() -> None:
    recorded = record_a_session()
    assert len(recorded.c2s) == 4 and len(recorded.s2c) >= 4  # verdict, replies (, goodbye)
    assert b"secret plan" not in b"".join(s for _, s in recorded.c2s + recorded.s2c)
    e_c, e_s = recorded.message_1[:32], recorded.message_2[:32]

    # 1. Replay the recorded handshake into a responder that holds the server's key and the PSK.
    responder = NoiseHandshake(initiator=False, static=SERVER_KEY, psk=PSK, prologue=prologue())
    responder.read_message_1(recorded.message_1)  # anyone can read message 1
    responder.write_message_2(b"")  # but its own ephemeral is not the one that was used
    with pytest.raises(NoiseError):
        responder.read_message_3(recorded.message_3)
    # 2. Replay it into an initiator that holds the client's key and the PSK.
    initiator = NoiseHandshake(initiator=True, static=CLIENT_KEY, psk=PSK, prologue=prologue())
    initiator.write_message_1(b"")
    with pytest.raises(NoiseError):
        initiator.read_message_2(recorded.message_2)
    # 3. Rebuild the key chain by hand, with every DH value the long-term keys give in place of
    #    ee (the one they cannot give), and the keys of the failed replays above.
    es, se = _dh(SERVER_KEY, e_c), _dh(CLIENT_KEY, e_s)
    candidates = {
        "ss": _dh(CLIENT_KEY, SERVER_KEY.public),
        "es": es,
        "se": se,
        "client key with its own ephemeral": _dh(CLIENT_KEY, e_c),
        "server key with its own ephemeral": _dh(SERVER_KEY, e_s),
        "zeros": bytes(32),
    }
    tried = [session_keys(recorded, ee, es, se, PSK) for ee in candidates.values()]
    tried.append(list(responder.split()))
    tried.append(list(initiator.split()))
    for keys in tried:
        for key in keys:
            assert opens(key, recorded.s2c[:1]) is None
            assert opens(key, recorded.c2s[:1]) is None


def test_with_the_ephemeral_keys_the_same_reconstruction_opens_every_record() -> None:
    """The control: the reconstruction above is right, and only the ephemerals were missing.
    A protocol without forward secrecy (keys from long-term values alone) would fail the test
    above exactly as this one passes."""
    e_client, e_server = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    recorded = record_a_session([e_client], [e_server])
    assert recorded.message_1[:32] == _public(e_client)
    assert recorded.message_2[:32] == _public(e_server)
    ee = _dh(e_client, recorded.message_2[:32])
    es, se = _dh(SERVER_KEY, recorded.message_1[:32]), _dh(CLIENT_KEY, recorded.message_2[:32])
    to_server, to_client = session_keys(recorded, ee, es, se, PSK)
    replies = opens(to_client, recorded.s2c)
    requests = opens(to_server, recorded.c2s)
    assert replies is not None and requests is not None
    limits = FrameLimits()
    metas = [decode_message(memoryview(p), limits).meta for p in requests[:3]]
    assert metas == [{"secret plan": n} for n in range(3)]
    # And a Noise replay of either side, given that side's ephemeral, reproduces its messages.
    initiator = NoiseHandshake(
        initiator=True, static=CLIENT_KEY, psk=PSK, prologue=prologue(), ephemeral=lambda: e_client
    )
    assert initiator.write_message_1(_payload_of_message_1(recorded)) == recorded.message_1
    server_hello = initiator.read_message_2(recorded.message_2)
    assert initiator.write_message_3(b"") == recorded.message_3
    assert list(initiator.split()) == [to_server, to_client]
    responder = NoiseHandshake(
        initiator=False, static=SERVER_KEY, psk=PSK, prologue=prologue(), ephemeral=lambda: e_server
    )
    responder.read_message_1(recorded.message_1)
    assert responder.write_message_2(server_hello) == recorded.message_2
    responder.read_message_3(recorded.message_3)
    assert list(responder.split()) == [to_server, to_client]


def _payload_of_message_1(recorded: Recording) -> bytes:
    """Readable by anyone: message 1's key comes from public values."""
    reader = NoiseHandshake(
        initiator=False, static=NodeKey.generate(), psk=PSK, prologue=prologue()
    )
    return reader.read_message_1(recorded.message_1)
