"""Discovery beacons: signed UDP datagrams a ``--pp-peer`` sends so the coordinator finds it.

``--cluster-discovery=mdns`` (docs/zero-config.md): signed UDP beacons, not DNS-SD.
A beacon is one datagram::

    {"addr":"192.168.1.11:40123","cluster":"studio-pp","nonce":"<32 hex>","ts":1700000000,"v":1}
    <64 hex: HMAC-SHA256 of the line above>

The JSON line is canonical (sorted keys, no spaces, ASCII) and the two parts are joined by one
``\\n``. The MAC key is HKDF-SHA256 of the cluster secret, so the secret never travels and
a beacon key is useless for the TCP handshake. A receiver bounds the size before looking at the
bytes and checks the MAC before parsing, so unauthenticated traffic never reaches the JSON parser.
A replayed beacon within the age window only re-announces the same address, so nonces are not
remembered; the nonce keeps two beacons of the same second distinct.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import re
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxppd.core.config.addresses import join_host_port
from mlxppd.core.config.cluster import parse_address
from mlxppd.core.errors import ConfigurationError, MlxppError

__all__ = [
    "BEACON_VERSION",
    "HKDF_INFO",
    "HKDF_SALT",
    "MAX_BEACON_BYTES",
    "REJECT_REASONS",
    "Beacon",
    "BeaconRejected",
    "DiscoveryStats",
    "BeaconRejectReason",
    "announce_address",
    "beacon_key",
    "collect_peers",
    "decode_beacon",
    "encode_beacon",
    "send_beacons",
]

log = logging.getLogger(__name__)

HKDF_SALT = b"mlxpp discovery"
HKDF_INFO = b"mlxpp beacon v1"
BEACON_VERSION = 1
#: a real beacon is ~200 bytes; anything longer is refused before it is looked at
MAX_BEACON_BYTES = 512

BeaconRejectReason = Literal[
    "oversize", "malformed", "unsigned", "bad_mac", "foreign_cluster", "stale"
]
REJECT_REASONS: tuple[BeaconRejectReason, ...] = (
    "oversize",
    "malformed",
    "unsigned",
    "bad_mac",
    "foreign_cluster",
    "stale",
)

_FIELDS = frozenset({"v", "cluster", "addr", "ts", "nonce"})
_NONCE = re.compile(r"[0-9a-f]{32}")
_MAC = re.compile(rb"[0-9a-f]{64}")
# Timestamps past 2**53 do not survive float arithmetic; no honest clock gets there.
_MAX_TS = 2**53


class BeaconRejected(MlxppError):
    """A datagram is not a beacon of this cluster; ``reason`` is one of ``REJECT_REASONS``."""

    def __init__(self, reason: BeaconRejectReason):
        self.reason: BeaconRejectReason = reason
        super().__init__(f"discovery beacon rejected: {reason}")


@dataclass(frozen=True)
class Beacon:
    """An authentic, fresh beacon of this cluster."""

    cluster_name: str
    #: "host:port" the peer listens on for its stage assignment
    address: str
    ts: int
    nonce: str


@dataclass
class DiscoveryStats:
    """Counters of one listener: accepted peers, repeats, and rejections by reason."""

    accepted: int = 0
    #: authentic beacons from an address already collected
    duplicate: int = 0
    rejected: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> dict[str, int]:
        """Every counter, zeros included, so a metrics exporter sees a fixed set of keys."""
        out = {"accepted": self.accepted, "duplicate": self.duplicate}
        out.update({reason: self.rejected[reason] for reason in REJECT_REASONS})
        return out


def beacon_key(secret: bytes) -> bytes:
    """The 32-byte beacon MAC key, derived from the cluster secret (never the secret itself)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=HKDF_SALT, info=HKDF_INFO).derive(secret)


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, "sha256").hexdigest().encode("ascii")


def encode_beacon(
    key: bytes, *, cluster_name: str, address: str, now: float, nonce: str | None = None
) -> bytes:
    """One signed beacon announcing ``address`` for ``cluster_name`` at time ``now``."""
    if nonce is None:
        nonce = secrets.token_hex(16)
    elif not _NONCE.fullmatch(nonce):
        raise ValueError("a beacon nonce is 32 lowercase hex digits")
    body = json.dumps(
        {
            "v": BEACON_VERSION,
            "cluster": cluster_name,
            "addr": address,
            "ts": int(now),
            "nonce": nonce,
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    ).encode("ascii")
    data = body + b"\n" + _mac(key, body)
    if len(data) > MAX_BEACON_BYTES:
        raise ConfigurationError(
            f"the discovery beacon would be {len(data)} bytes (at most {MAX_BEACON_BYTES}); "
            "use a shorter --cluster-name or announce address",
            source="--cluster-name",
        )
    return data


def _fields(body: bytes) -> tuple[str, str, int, str]:
    """(cluster, addr, ts, nonce) of an authentic body; raises malformed on any surprise."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BeaconRejected("malformed") from None
    if not isinstance(doc, dict) or set(doc) != _FIELDS:
        raise BeaconRejected("malformed")
    version, cluster, addr, ts, nonce = (doc[k] for k in ("v", "cluster", "addr", "ts", "nonce"))
    # bool is an int subclass; a beacon's numbers are never booleans.
    if type(version) is not int or version != BEACON_VERSION:
        raise BeaconRejected("malformed")
    if type(ts) is not int or not 0 <= ts < _MAX_TS:
        raise BeaconRejected("malformed")
    if not isinstance(cluster, str) or not isinstance(addr, str) or not isinstance(nonce, str):
        raise BeaconRejected("malformed")
    if not _NONCE.fullmatch(nonce):
        raise BeaconRejected("malformed")
    try:
        parse_address(addr)
    except ValueError:
        raise BeaconRejected("malformed") from None
    return cluster, addr, ts, nonce


def decode_beacon(
    key: bytes, data: bytes, *, cluster_name: str, now: float, max_age_s: float = 30.0
) -> Beacon:
    """The beacon in ``data``, or BeaconRejected saying why not.

    Checks run cheapest-first and the MAC before any parsing: size, the MAC part, the MAC,
    the JSON shape, the cluster name, then the age (either direction, so a clock far ahead
    is as suspect as a replay).
    """
    if len(data) > MAX_BEACON_BYTES:
        raise BeaconRejected("oversize")
    body, sep, mac = data.partition(b"\n")
    if not sep or not mac:
        raise BeaconRejected("unsigned")
    if not _MAC.fullmatch(mac) or not hmac.compare_digest(mac, _mac(key, body)):
        raise BeaconRejected("bad_mac")
    cluster, addr, ts, nonce = _fields(body)
    if cluster != cluster_name:
        raise BeaconRejected("foreign_cluster")
    if abs(now - ts) > max_age_s:
        raise BeaconRejected("stale")
    return Beacon(cluster_name=cluster, address=addr, ts=ts, nonce=nonce)


def announce_address(bind_host: str, port: int, target: str) -> str:
    """The "ip:port" a peer bound to ``bind_host``:``port`` announces to ``target``.

    A concrete bind IP is announced as is. A wildcard (or a name) is replaced by the local IP
    the OS routes ``target`` through: a UDP connect picks the route and sends nothing. ``port``
    must be the port actually bound (not 0).
    """
    if not 1 <= port <= 65535:
        raise ValueError(f"announce a bound port (1-65535), not {port}")
    try:
        ip = ipaddress.ip_address(bind_host.strip("[]"))
    except ValueError:
        ip = None
    if ip is not None and not ip.is_unspecified:
        return join_host_port(str(ip), port)
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            # Without SO_BROADCAST the kernel refuses to route toward a broadcast address.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            probe.connect((target, 9))
            local = str(probe.getsockname()[0])
    except OSError as exc:
        raise ConfigurationError(
            f"no route from this host to the discovery target {target} ({exc.strerror or exc}); "
            "give --cluster-control-addr a concrete IP or check --cluster-discovery-target",
            source="--cluster-control-addr",
        ) from None
    return join_host_port(local, port)


def _udp_socket(family: socket.AddressFamily) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    return sock


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# UDP through the socket and a readiness callback, not loop.sock_sendto/sock_recvfrom:
# uvloop, which mlxppd runs on, does not implement those two.


def _send_datagram(sock: socket.socket, data: bytes, target: tuple[str, int]) -> None:
    """Send one datagram now; a full send buffer drops it (beacons repeat every interval)."""
    with contextlib.suppress(BlockingIOError):
        sock.sendto(data, target)


async def _recv_datagram(sock: socket.socket, max_bytes: int) -> tuple[bytes, object]:
    """The next datagram (at most ``max_bytes``, longer ones truncated) and its sender."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return sock.recvfrom(max_bytes)
        except BlockingIOError:
            pass
        readable = loop.create_future()

        def wake(future: asyncio.Future[None] = readable) -> None:
            if not future.done():
                future.set_result(None)

        loop.add_reader(sock.fileno(), wake)
        try:
            await readable
        finally:
            loop.remove_reader(sock.fileno())


async def send_beacons(
    key: bytes,
    *,
    cluster_name: str,
    address: str,
    target: tuple[str, int],
    interval_s: float,
    stop: asyncio.Event,
    clock: Callable[[], float] = time.time,
) -> None:
    """Send a fresh beacon to ``target`` every ``interval_s`` until ``stop`` is set.

    A send that fails (no route yet, interface down) is logged once and retried next interval:
    the network may come up after the daemon does.
    """
    warned = False
    with _udp_socket(_family(target[0])) as sock:
        while not stop.is_set():
            data = encode_beacon(key, cluster_name=cluster_name, address=address, now=clock())
            try:
                _send_datagram(sock, data, target)
            except OSError as exc:
                if not warned:
                    log.warning(
                        "cannot send discovery beacons to %s:%d: %s; still trying",
                        target[0],
                        target[1],
                        exc.strerror or exc,
                    )
                    warned = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


async def collect_peers(
    key: bytes,
    *,
    cluster_name: str,
    want: int,
    timeout_s: float,
    bind: tuple[str, int],
    stats: DiscoveryStats,
    clock: Callable[[], float] = time.time,
    on_peer: Callable[[Beacon], None] | None = None,
    on_listening: Callable[[tuple[str, int]], None] | None = None,
) -> list[Beacon]:
    """Listen on UDP ``bind`` until ``want`` distinct peer addresses announced themselves.

    Returns the first beacon of each address in arrival order (the planner sorts), or what it
    has after ``timeout_s``; the caller decides whether too few is an error. ``on_listening``
    gets the bound address once the socket is open (useful with port 0).
    """
    found: dict[str, Beacon] = {}
    with _udp_socket(_family(bind[0])) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(bind)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot listen for discovery beacons on UDP {join_host_port(*bind)}: "
                f"{exc.strerror or exc}; stop the process holding that port or change "
                "--cluster-discovery-port",
                source="--cluster-discovery-port",
            ) from None
        if on_listening is not None:
            bound = sock.getsockname()
            on_listening((str(bound[0]), int(bound[1])))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while len(found) < want:
                    # One byte past the bound: a longer datagram is truncated, and seen as oversize.
                    data, sender = await _recv_datagram(sock, MAX_BEACON_BYTES + 1)
                    try:
                        beacon = decode_beacon(key, data, cluster_name=cluster_name, now=clock())
                    except BeaconRejected as exc:
                        stats.rejected[exc.reason] += 1
                        log.debug("ignored a datagram from %s: %s", sender, exc.reason)
                        continue
                    if beacon.address in found:
                        stats.duplicate += 1
                        continue
                    stats.accepted += 1
                    found[beacon.address] = beacon
                    log.info("discovered peer %s (beacon from %s)", beacon.address, sender)
                    if on_peer is not None:
                        on_peer(beacon)
    return list(found.values())
