"""Discovery beacons (mlxppd.wire.discovery): signed UDP datagrams, real sockets on 127.0.0.1.

A coordinator collects the peers of its own cluster and ignores, and counts, everything else:
unsigned or wrongly signed datagrams, another cluster's beacons, old ones, junk and floods.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxppd.core.errors import ConfigurationError
from mlxppd.wire.discovery import (
    MAX_BEACON_BYTES,
    REJECT_REASONS,
    Beacon,
    BeaconRejected,
    DiscoveryStats,
    announce_address,
    beacon_key,
    collect_peers,
    decode_beacon,
    encode_beacon,
    send_beacons,
)
from tests.support.wire import run

pytestmark = pytest.mark.timeout(60)

KEY = beacon_key(b"7f3c9a1e5b2d4c6a8e0f1a2b3c4d5e6f")
OTHER_KEY = beacon_key(b"a-different-secret-of-32-bytes!!")
CLUSTER = "studio-pp"
NOW = 1_700_000_000.0
PEER = "127.0.0.1:40001"


def beacon(
    address: str = PEER, *, key: bytes = KEY, cluster: str = CLUSTER, now: float = NOW
) -> bytes:
    return encode_beacon(key, cluster_name=cluster, address=address, now=now)


def signed(body: bytes, key: bytes = KEY) -> bytes:
    """``body`` with a valid MAC: what only a holder of the secret can produce."""
    return body + b"\n" + hmac.new(key, body, "sha256").hexdigest().encode()


def rejection(data: bytes, *, now: float = NOW) -> str:
    with pytest.raises(BeaconRejected) as info:
        decode_beacon(KEY, data, cluster_name=CLUSTER, now=now)
    return info.value.reason


# -- the beacon format ---------------------------------------------------------------------------


def test_a_beacon_round_trips() -> None:
    data = encode_beacon(KEY, cluster_name=CLUSTER, address=PEER, now=NOW + 0.7, nonce="ab" * 16)

    assert decode_beacon(KEY, data, cluster_name=CLUSTER, now=NOW + 5) == Beacon(
        cluster_name=CLUSTER, address=PEER, ts=int(NOW), nonce="ab" * 16
    )


def test_a_beacon_is_canonical_json_a_newline_and_a_hex_mac() -> None:
    data = encode_beacon(KEY, cluster_name=CLUSTER, address=PEER, now=NOW, nonce="0f" * 16)
    body, mac = data.split(b"\n")

    assert body == (
        b'{"addr":"127.0.0.1:40001","cluster":"studio-pp","nonce":"'
        + b"0f" * 16
        + b'","ts":1700000000,"v":1}'
    )
    assert len(mac) == 64 and int(mac, 16) >= 0
    assert len(data) <= MAX_BEACON_BYTES


def test_every_beacon_has_a_fresh_nonce() -> None:
    assert beacon() != beacon()


def test_the_beacon_key_is_derived_and_differs_per_secret() -> None:
    secret = b"7f3c9a1e5b2d4c6a8e0f1a2b3c4d5e6f"

    assert len(KEY) == 32 and KEY != secret[:32]
    assert beacon_key(secret) == KEY and KEY != OTHER_KEY


def test_a_cluster_name_too_long_for_a_datagram_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"^--cluster-name: the discovery beacon"):
        beacon(cluster="x" * 500)


def flip_last_hex(data: bytes) -> bytes:
    """The datagram with its last MAC digit changed (always to a different digit)."""
    return data[:-1] + (b"1" if data[-1:] == b"0" else b"0")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"x" * (MAX_BEACON_BYTES + 1), "oversize"),
        (b'{"v":1}', "unsigned"),
        (b'{"v":1}\n', "unsigned"),
        (beacon(key=OTHER_KEY), "bad_mac"),
        (beacon().upper(), "bad_mac"),
        (flip_last_hex(beacon()), "bad_mac"),
        (beacon()[:-1], "bad_mac"),
        (beacon().replace(b"studio", b"stUdio"), "bad_mac"),
        (beacon(cluster="other-cluster"), "foreign_cluster"),
        (beacon(now=NOW - 31), "stale"),
        (beacon(now=NOW + 31), "stale"),  # a clock far ahead is as suspect as a replay
        (signed(b"not json"), "malformed"),
        (signed(b"\xff\xfe"), "malformed"),
        (signed(b"[1, 2]"), "malformed"),
        (signed(b'{"v":1}'), "malformed"),
    ],
)
def test_a_bad_datagram_is_rejected_with_its_reason(data: bytes, reason: str) -> None:
    assert rejection(data) == reason


def good_fields(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "v": 1,
        "cluster": CLUSTER,
        "addr": PEER,
        "ts": int(NOW),
        "nonce": "0" * 32,
    }
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not None}


@pytest.mark.parametrize(
    "changes",
    [
        {"v": 2},
        {"v": True},
        {"v": "1"},
        {"ts": 1.7e9},
        {"ts": -1},
        {"ts": 10**300},  # past float range: must not overflow the age check
        {"ts": True},
        {"nonce": "XYZ"},
        {"nonce": "A" * 32},
        {"addr": "0.0.0.0:1"},
        {"addr": "no-port"},
        {"addr": 5},
        {"cluster": None},
        {"extra": 1},
    ],
)
def test_an_authentic_beacon_of_the_wrong_shape_is_malformed(changes: dict[str, Any]) -> None:
    body = json.dumps(good_fields(**changes), separators=(",", ":")).encode()

    assert rejection(signed(body)) == "malformed"


def test_the_mac_is_checked_before_the_cluster_name_and_the_age() -> None:
    foreign_and_old = encode_beacon(OTHER_KEY, cluster_name="other", address=PEER, now=0)

    assert rejection(foreign_and_old) == "bad_mac"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=MAX_BEACON_BYTES + 64))
def test_arbitrary_bytes_only_ever_raise_beacon_rejected(data: bytes) -> None:
    with pytest.raises(BeaconRejected):
        decode_beacon(KEY, data, cluster_name=CLUSTER, now=NOW)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=400).filter(lambda b: b"\n" not in b),
        JSON.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(st.sampled_from(["v", "cluster", "addr", "ts", "nonce"]), JSON).map(
            lambda d: json.dumps(d).encode()
        ),
    )
)
def test_any_authentic_body_parses_or_is_rejected_never_crashes(body: bytes) -> None:
    # A holder of the secret gets past the MAC; the parser must still never raise anything else.
    try:
        decode_beacon(KEY, signed(body), cluster_name=CLUSTER, now=NOW)
    except BeaconRejected:
        pass


# -- the announced address -----------------------------------------------------------------------


def test_a_concrete_bind_address_is_announced_as_is() -> None:
    assert announce_address("192.168.1.11", 19001, "255.255.255.255") == "192.168.1.11:19001"
    assert announce_address("::1", 19001, "::1") == "[::1]:19001"


def test_a_wildcard_bind_announces_the_ip_that_routes_to_the_target() -> None:
    assert announce_address("0.0.0.0", 40123, "127.0.0.1") == "127.0.0.1:40123"


def test_an_unbound_port_cannot_be_announced() -> None:
    with pytest.raises(ValueError, match="bound port"):
        announce_address("0.0.0.0", 0, "127.0.0.1")


# -- sockets -------------------------------------------------------------------------------------


class Listener:
    """collect_peers running in a task, with its bound address once the socket is open."""

    def __init__(
        self, want: int, timeout_s: float = 120.0, announce: Sequence[bytes] = (), **kwargs: Any
    ):
        """``announce``: datagrams sent to the socket as soon as it is bound, before the
        timeout starts, so they are there however slow the machine is."""
        self.stats = DiscoveryStats()
        self.ready = asyncio.Event()
        self.address: tuple[str, int] = ("", 0)
        self._announce = announce
        self.task = asyncio.create_task(
            collect_peers(
                KEY,
                cluster_name=CLUSTER,
                want=want,
                timeout_s=timeout_s,
                bind=("127.0.0.1", 0),
                stats=self.stats,
                on_listening=self._listening,
                **kwargs,
            )
        )

    def _listening(self, address: tuple[str, int]) -> None:
        self.address = address
        send_raw(address, *self._announce)
        self.ready.set()

    async def open(self) -> Listener:
        await self.ready.wait()
        return self


@contextlib.asynccontextmanager
async def peer_sending(address: str, target: tuple[str, int], **kwargs: Any) -> Any:
    """A --pp-peer's beacon loop, stopped and awaited on exit."""
    stop = asyncio.Event()
    settings = {"cluster_name": CLUSTER, "interval_s": 0.05, **kwargs}
    task = asyncio.create_task(
        send_beacons(KEY, address=address, target=target, stop=stop, **settings)
    )
    try:
        yield task
    finally:
        stop.set()
        await task


def send_raw(target: tuple[str, int], *datagrams: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for data in datagrams:
            sock.sendto(data, target)


def test_a_peer_sending_beacons_is_collected() -> None:
    async def scenario() -> tuple[list[Beacon], list[str], dict[str, int]]:
        seen: list[str] = []
        listener = await Listener(want=1, on_peer=lambda b: seen.append(b.address)).open()
        async with peer_sending(PEER, listener.address):
            found = await listener.task
        return found, seen, listener.stats.snapshot()

    found, seen, stats = run(scenario)

    assert [b.address for b in found] == [PEER] and seen == [PEER]
    assert found[0].cluster_name == CLUSTER
    assert stats["accepted"] == 1


def test_junk_is_ignored_and_counted_while_a_good_peer_is_still_collected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    junk = {
        "unsigned": b'{"addr":"127.0.0.1:9"}',
        "bad_mac": beacon("127.0.0.1:9", key=OTHER_KEY, now=time.time()),
        "stale": beacon("127.0.0.1:9", now=time.time() - 3600),
        "foreign_cluster": beacon("127.0.0.1:9", cluster="another", now=time.time()),
        "malformed": signed(b'{"v":1,"addr":"127.0.0.1:9"}'),
        "oversize": b"A" * 4000,
    }

    async def scenario() -> tuple[list[Beacon], dict[str, int]]:
        listener = await Listener(want=1).open()
        # Sent in order before the good beacon, so each is read (and counted) first.
        send_raw(listener.address, *junk.values(), beacon(PEER, now=time.time()))
        return await listener.task, listener.stats.snapshot()

    with caplog.at_level(logging.DEBUG, logger="mlxppd.wire.discovery"):
        found, stats = run(scenario)

    assert [b.address for b in found] == [PEER]
    expected: dict[str, int] = {"accepted": 1, "duplicate": 0}
    expected.update(dict.fromkeys(REJECT_REASONS, 1))
    assert stats == expected
    # Rejections are logged with reason and sender, never with the datagram's bytes.
    messages = [r.getMessage() for r in caplog.records]
    ignored = [m for m in messages if m.startswith("ignored a datagram from ('127.0.0.1', ")]
    assert sorted(m.rsplit(": ", 1)[1] for m in ignored) == sorted(REJECT_REASONS)
    assert not any("AAAA" in m or "127.0.0.1:9" in m for m in messages)


def test_the_clock_parameter_decides_staleness() -> None:
    async def scenario() -> dict[str, int]:
        # The listener's clock is an hour ahead of the sender's: every beacon is stale. The
        # beacon waits in the socket before the timeout starts.
        fresh = beacon(PEER, now=time.time())
        listener = Listener(
            want=1, timeout_s=0.5, clock=lambda: time.time() + 3600, announce=[fresh]
        )
        assert await asyncio.wait_for(listener.task, timeout=60) == []
        return listener.stats.snapshot()

    stats = run(scenario)

    assert stats["accepted"] == 0 and stats["stale"] == 1


def test_repeated_beacons_from_one_address_count_once() -> None:
    async def scenario() -> tuple[list[Beacon], dict[str, int]]:
        listener = await Listener(want=2).open()
        now = time.time()
        send_raw(listener.address, beacon(PEER, now=now), beacon(PEER, now=now))
        send_raw(listener.address, beacon(PEER, now=now), beacon("127.0.0.1:40002", now=now))
        return await listener.task, listener.stats.snapshot()

    found, stats = run(scenario)

    assert [b.address for b in found] == [PEER, "127.0.0.1:40002"]
    assert stats["accepted"] == 2 and stats["duplicate"] == 2


def test_several_peers_are_collected_until_enough_have_announced() -> None:
    peers = [f"127.0.0.1:{40001 + i}" for i in range(3)]

    async def scenario() -> list[Beacon]:
        listener = await Listener(want=3).open()
        async with contextlib.AsyncExitStack() as stack:
            for address in peers:
                await stack.enter_async_context(peer_sending(address, listener.address))
            return await listener.task

    assert sorted(b.address for b in run(scenario)) == peers


def test_the_timeout_returns_the_peers_found_so_far() -> None:
    async def scenario() -> tuple[list[Beacon], float]:
        start = time.monotonic()
        # One peer's beacon waits in the socket before the 0.5 s timeout starts; the second
        # peer never announces itself.
        listener = Listener(want=2, timeout_s=0.5, announce=[beacon(PEER, now=time.time())])
        # Generous: only a listener that ignores its timeout runs into this one.
        found = await asyncio.wait_for(listener.task, timeout=60)
        return found, time.monotonic() - start

    found, elapsed = run(scenario)

    assert [b.address for b in found] == [PEER]
    assert elapsed > 0.4  # it waited for the second peer until the timeout


def test_wanting_no_peers_returns_at_once() -> None:
    async def scenario() -> list[Beacon]:
        return await Listener(want=0).task

    assert run(scenario) == []


def test_a_send_failure_is_logged_once_and_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        # Port 0 is not a destination: every send fails.
        async with peer_sending(PEER, ("127.0.0.1", 0), interval_s=0.01):
            await asyncio.sleep(0.2)

    with caplog.at_level(logging.WARNING, logger="mlxppd.wire.discovery"):
        run(scenario)

    warnings = [r for r in caplog.records if "cannot send discovery beacons" in r.getMessage()]
    assert len(warnings) == 1


def test_a_busy_discovery_port_names_the_flag() -> None:
    async def scenario() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
            holder.bind(("127.0.0.1", 0))  # no SO_REUSEADDR, so a second bind fails
            await collect_peers(
                KEY,
                cluster_name=CLUSTER,
                want=1,
                timeout_s=1,
                bind=holder.getsockname(),
                stats=DiscoveryStats(),
            )

    with pytest.raises(ConfigurationError, match=r"^--cluster-discovery-port: cannot listen"):
        run(scenario)
