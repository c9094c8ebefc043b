"""Zero-config bring-up: ``serve --pp-auto N`` plans and assigns, ``serve --pp-peer`` waits.

The coordinator finds its peers (``--cluster-peers``, or signed UDP beacons), asks each to
describe itself (hello: version, model identity, memory), plans the cluster deterministically,
and pushes one offer per peer over the secure transport. Only when every peer accepted does it
commit, and only when every peer committed does it activate; a peer writes the TOML it received
and serves its stage only on activate. Both ends then run exactly the code a hand-written
cluster TOML runs (``run_stage_node`` / ``run_coordinator_node``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxppd import __version__
from mlxppd.core.config.addresses import split_host_port
from mlxppd.core.config.cluster import ClusterConfig, parse_address, parse_cluster_config
from mlxppd.core.config.render import render_cluster_toml
from mlxppd.core.config.roster import Roster
from mlxppd.core.errors import ConfigurationError, PeerRefusedError, TemporaryError
from mlxppd.core.partition.launch import cluster_partition_plan, launch_warnings
from mlxppd.core.profile.model import profile_from_config, read_model_config
from mlxppd.core.protocol.assignment import (
    MAX_MEMORY_BYTES,
    Abort,
    Activate,
    AssignmentReply,
    Commit,
    Hello,
    HelloReply,
    ModelIdentity,
    Offer,
    RefusalReason,
    check_offer,
    parse_assignment,
)
from mlxppd.core.protocol.control import clip
from mlxppd.core.zeroconf.plan import (
    PeerInfo,
    dry_run_problems,
    peer_notes,
    plan_cluster,
    sort_peers,
    topology_summary,
)
from mlxppd.engine.model_files import resolve_model_dir
from mlxppd.engine.model_identity import model_identity
from mlxppd.runtime.coordinator.control_client import BadReplyError, ControlClient
from mlxppd.runtime.serve import NodeOptions, with_adapter_flags, write_ready
from mlxppd.runtime.system.atomic_write import write_text_atomic
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.discovery import (
    DiscoveryStats,
    announce_address,
    beacon_key,
    collect_peers,
    send_beacons,
)
from mlxppd.wire.errors import ChannelClosedError, FrameError, VersionMismatchError
from mlxppd.wire.node_key import NodeKey, save_node_key
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.secret import ClusterSecret, load_cluster_secret
from mlxppd.wire.tasks import spawn, stop_tasks
from mlxppd.wire.tcp import TcpTransport
from mlxppd.wire.transport import WireConfig
from mlxppd.wire.version import PROTOCOL_VERSION

log = logging.getLogger("mlxppd.zeroconf")

COORDINATOR_ID = "coordinator"
PEER_ID = "peer"
DEFAULT_CONTROL_PORT = 39600  # the default transport port range's first


@dataclass(frozen=True)
class ZeroConfig:
    """The zero-config flags (docs/zero-config.md)."""

    num_stages: int | None = None
    """--pp-auto N (coordinator)"""
    discovery: str = "static"
    peers: tuple[str, ...] = ()
    cluster_name: str = "mlxpp-cluster"
    discovery_port: int = 49555
    discovery_target: str = "255.255.255.255"
    control_addr: str | None = None
    config_out: Path | None = None
    dry_run: bool = False
    discovery_timeout_s: float = 120.0
    """seconds to wait for peers (beacons, or static peers still starting)"""
    transport_backend: str = "tcp"
    """--transport-backend: how the stages talk (tcp, thunderbolt, rdma)"""
    reply_timeout_s: float = 60.0


def _secret(options: NodeOptions) -> ClusterSecret:
    return load_cluster_secret(flag_path=options.secret_file)


def _bringup_wire(z: ZeroConfig, node_id: str, peer_id: str, secret: ClusterSecret) -> WireConfig:
    """The bring-up's wire: a fresh node key, and (no roster exists yet) whatever key the
    other side proves, the cluster secret being the one factor; the TOML it ends with lists
    every key seen, so the cluster then serves with node keys like any other."""
    key = NodeKey.generate(f"this {node_id}'s zero-config key")
    return WireConfig(z.cluster_name, node_id, secret, key, RosterBook(Roster.trusting(peer_id)))


def key_file_beside(cluster_file: Path) -> Path:
    """Where a zero-config node keeps its node key: next to the TOML it serves from."""
    return cluster_file.with_name(cluster_file.stem + ".node.key")


def _save_key_beside(key: NodeKey, cluster_file: Path) -> Path:
    """Write ``key`` beside the TOML about to be written (its folder made first, as the TOML's
    is): written before the TOML, so a TOML there always has its key."""
    path = key_file_beside(cluster_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_node_key(key, path, force=True)
    return path


def with_roster(plan: ClusterConfig, keys: dict[str, bytes]) -> ClusterConfig:
    """``plan`` with a ``[roster]`` of ``keys`` (validated like a hand-written one)."""
    data = plan.model_dump(mode="json", exclude_unset=True)
    data["roster"] = Roster.of(keys).as_table()
    return ClusterConfig.model_validate(data)


def host_memory_bytes() -> int | None:
    """Physical memory of this host (what a peer reports for planning); None if unknown."""
    try:
        memory = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
    return memory if 0 < memory < MAX_MEMORY_BYTES else None


# -- the coordinator -------------------------------------------------------------------------


@dataclass
class _Peer:
    """One peer during the assignment: its address and its channel's request/reply helper."""

    address: str
    control: ControlClient
    reader: asyncio.Task[None] | None = field(default=None)
    memory_bytes: int | None = None
    #: the node key the peer proved in the handshake (its line in the TOML's [roster])
    key: bytes = b""

    @classmethod
    def start(cls, address: str, channel: SecureChannel, timeout_s: float) -> _Peer:
        control = ControlClient(channel, timeout_s)
        reader = spawn(control.read_replies(), name=f"peer-{address}")
        return cls(address, control, reader, key=channel.peer_key)

    async def close(self) -> None:
        await self.control.channel.close()
        await stop_tasks(self.reader, cancel=False, ignore_errors=True)


async def _connect(
    transport: TcpTransport, address: str, deadline: float, retry: bool
) -> SecureChannel:
    host, port = parse_address(address)
    while True:
        try:
            return await transport.connect(host, port)
        except TemporaryError:
            if not retry or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _resolve_peers(z: ZeroConfig, secret: ClusterSecret) -> list[str]:
    if z.discovery == "static":
        return list(z.peers)
    assert z.num_stages is not None
    stats = DiscoveryStats()
    log.info(
        "waiting up to %.0f s for %d peers' beacons on UDP port %d (cluster %s)",
        z.discovery_timeout_s, z.num_stages, z.discovery_port, z.cluster_name,
    )  # fmt: skip
    beacons = await collect_peers(
        beacon_key(secret.key_bytes()),
        cluster_name=z.cluster_name,
        want=z.num_stages,
        timeout_s=z.discovery_timeout_s,
        bind=("0.0.0.0", z.discovery_port),
        stats=stats,
    )
    ignored = {k: v for k, v in stats.snapshot().items() if k != "accepted" and v}
    if ignored:
        log.info("ignored beacons: %s", ignored)
    return [b.address for b in beacons]


@dataclass
class PeerVersions:
    """What each peer runs, for the dry run: a note per peer, a problem per mismatch."""

    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


async def _hello(
    transport: TcpTransport, address: str, deadline: float, z: ZeroConfig, versions: PeerVersions
) -> _Peer | None:
    """A peer's channel and its description; None when a dry run could not reach it (a real
    bring-up raises, naming the peer and what to check)."""
    try:
        channel = await _connect(transport, address, deadline, retry=True)
    except VersionMismatchError as exc:
        if not z.dry_run:
            raise
        versions.problems.append(f"peer {address}: {exc}")
        return None
    except PeerRefusedError as exc:
        # A peer that fails the handshake (another secret) is never offered anything.
        raise PeerRefusedError(
            f"peer {address} refused the handshake: {exc}; it holds another cluster "
            "secret or --cluster-name"
        ) from None
    except (TemporaryError, OSError) as exc:
        if not z.dry_run:
            raise TemporaryError(
                f"peer {address} did not answer: {exc}; check that `mlxppd serve "
                "--pp-peer` runs there and that its --cluster-control-addr matches"
            ) from None
        return None
    peer = _Peer.start(address, channel, z.reply_timeout_s)
    try:
        # What a peer reports is bounded (HelloReply) before it is used.
        hello = await peer.control.ask(Hello(), HelloReply)
    except BadReplyError as exc:
        await peer.close()
        raise PeerRefusedError(f"peer {address}: {exc}") from None
    peer.memory_bytes = hello.memory_bytes
    versions.notes.append(
        f"peer {address} runs mlxpp {hello.version}, wire protocol {PROTOCOL_VERSION}"
    )
    if hello.version != __version__:
        versions.problems.append(
            f"peer {address} runs mlxpp {hello.version}, this node {__version__}; install the "
            "same version on every host"
        )
    return peer


async def coordinate(options: NodeOptions, z: ZeroConfig, out: Any = None) -> NodeOptions | int:
    """Plan and assign. Returns the options ``run_coordinator_node`` needs, or (dry run) an
    exit status."""
    out = out or sys.stdout
    assert z.num_stages is not None
    secret = _secret(options)
    model_dir = resolve_model_dir(options.model)
    identity = model_identity(model_dir)
    profile = profile_from_config(read_model_config(model_dir))
    control = z.control_addr or f"{options.host}:{DEFAULT_CONTROL_PORT}"
    parse_address(control)
    config_out = z.config_out or Path(".mlxpp") / "cluster.toml"
    addresses = await _resolve_peers(z, secret)
    wire = _bringup_wire(z, COORDINATOR_ID, PEER_ID, secret)
    transport = TcpTransport(wire)
    deadline = time.monotonic() + (3.0 if z.dry_run else z.discovery_timeout_s)
    peers: list[_Peer] = []
    infos: list[PeerInfo] = []
    versions = PeerVersions()
    try:
        # Duplicates are an error (sort_peers names them), not silently merged.
        for address in [p.address for p in sort_peers([PeerInfo(a) for a in addresses])]:
            peer = await _hello(transport, address, deadline, z, versions)
            if peer is None:
                infos.append(PeerInfo(address, None, reachable=False))
                continue
            peers.append(peer)
            infos.append(PeerInfo(address, peer.memory_bytes))
        if z.dry_run:
            notes = peer_notes(infos) + versions.notes
            return _dry_run(options, z, control, config_out, infos, notes, profile, out, versions)
        plan = plan_cluster(
            name=z.cluster_name, control_addr=control, peers=infos,
            num_stages=z.num_stages, profile=profile, transport_backend=z.transport_backend,
        )  # fmt: skip
        # The peers get the adapters in the TOML they are assigned (same paths on every host).
        plan = with_adapter_flags(plan, options.adapters)
        keys = {p.address: p.key for p in peers}
        plan = with_roster(
            plan,
            {COORDINATOR_ID: wire.node_key.public}
            | {node.id: keys[node.address] for node in plan.stage_nodes()},
        )
        text = render_cluster_toml(plan)
        await _assign(plan, text, peers, identity)
        key_file = _save_key_beside(wire.node_key, config_out)
        _write(config_out, text)
        print(topology_summary(plan, str(config_out.resolve())), file=out, flush=True)
        return replace(
            options, cluster_file=config_out, node_id=COORDINATOR_ID, node_key_file=str(key_file)
        )
    finally:
        for peer in peers:
            await peer.close()


def _dry_run(
    options: NodeOptions, z: ZeroConfig, control: str, config_out: Path,
    infos: list[PeerInfo], notes: list[str], profile: Any, out: Any, versions: PeerVersions,
) -> int:  # fmt: skip
    assert z.num_stages is not None
    http = f"{options.host}:{options.port}"
    mine = [control] + ([http] if http != control else [])
    # Only the coordinator's own addresses: a peer on this host holds its port by right.
    bound = [a for a in mine if _bound_here(a)]
    problems = (
        dry_run_problems(
            num_stages=z.num_stages,
            peers_resolved=len(infos),
            control_addr=control,
            http_addr=http,
            bound_ports=bound,
            discovery_port=z.discovery_port,
        )
        + versions.problems
    )
    if len(infos) == z.num_stages:
        plan = plan_cluster(
            name=z.cluster_name, control_addr=control, peers=infos,
            num_stages=z.num_stages, profile=profile, transport_backend=z.transport_backend,
        )  # fmt: skip
        _write(config_out, render_cluster_toml(plan))
        print(topology_summary(plan, str(config_out.resolve()), notes), file=out, flush=True)
        transport = plan.cluster.transport_backend
        warnings = launch_warnings(cluster_partition_plan(plan, profile), transport)
        for warning in warnings:
            print(f"partition warning: {warning}", file=out, flush=True)
    for problem in problems:
        print(f"mlxppd: dry run: {problem}", file=sys.stderr, flush=True)
    return 1 if problems else 0


def _bound_here(address: str) -> bool:
    """True when ``address`` is this host's and its TCP port is taken by another process."""
    host, port = parse_address(address)
    if port == 0:
        return False
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))
        return False
    except OSError as exc:
        # Not an address of this host: nothing here can conflict with it.
        return exc.errno == 98 or "in use" in str(exc).lower()


async def _assign(
    plan: ClusterConfig, text: str, peers: list[_Peer], identity: ModelIdentity
) -> None:
    by_address = {p.address: p for p in peers}
    ordered = [(node, by_address[node.address]) for node in plan.stage_nodes()]
    ranges = plan.layer_plan(identity.num_layers)
    accepted: list[_Peer] = []
    try:
        for node, peer in ordered:
            assert node.stage is not None
            r = ranges[node.stage]
            offer = Offer(
                rid=0, node_id=node.id, stage=node.stage, layers=r.pair,
                model=identity, version=__version__, cluster=plan.cluster.name, topology=text,
            )  # fmt: skip
            verdict = await peer.control.ask(offer, AssignmentReply)
            if not verdict.ok:
                raise PeerRefusedError(
                    f"peer {peer.address} refused stage {node.stage} "
                    f"({verdict.reason}): {verdict.message}; nothing was started"
                )
            accepted.append(peer)
        for _, peer in ordered:
            reply = await peer.control.ask(Commit(), AssignmentReply)
            if not reply.ok:
                raise PeerRefusedError(f"peer {peer.address} did not commit: {reply.message}")
        log.info("every peer committed; activating")
        for _, peer in ordered:
            reply = await peer.control.ask(Activate(), AssignmentReply)
            if not reply.ok:
                raise PeerRefusedError(f"peer {peer.address} did not activate: {reply.message}")
    except BaseException as exc:
        for peer in accepted:
            with contextlib.suppress(Exception):
                await peer.control.ask(Abort(reason=clip(str(exc), 1000) or ""), AssignmentReply)
        if isinstance(exc, TimeoutError | ChannelClosedError | FrameError | BadReplyError):
            raise TemporaryError(
                f"the assignment did not complete ({exc or 'timeout'}); nothing was started"
            ) from None
        raise


def _bind_address(text: str) -> tuple[str, int]:
    """host:port to listen on; port 0 (any free port, announced by beacon) is allowed here."""
    address = split_host_port(text)
    if address is None or not address[0] or address[1] > 65535:
        raise ConfigurationError(
            f"'{text}' is not host:port (port 0: any free port)", source="--cluster-control-addr"
        )
    # A wildcard is fine to listen on; the peer announces its real address by beacon.
    return address


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


# -- the peer --------------------------------------------------------------------------------


@dataclass
class _Assignment:
    offer: Offer
    cluster: ClusterConfig
    committed: bool = False


class PeerServer:
    """Waits for an assignment; ``activated`` carries (cluster file, node id) once it came."""

    def __init__(
        self,
        options: NodeOptions,
        z: ZeroConfig,
        identity: ModelIdentity,
        address: str,
        node_key: NodeKey,
    ) -> None:
        self.options, self.z, self.identity = options, z, identity
        self.address = address
        self.node_key = node_key
        self.activated: asyncio.Future[tuple[Path, str]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending: _Assignment | None = None

    async def handle(self, channel: SecureChannel) -> None:
        try:
            async for message in channel:
                if message.kind is not MessageKind.CONTROL:
                    break
                reply = self._answer(message.meta)
                await channel.send(MessageKind.REPLY, reply.model_dump(mode="json"))
        except (ChannelClosedError, FrameError):
            pass
        finally:
            await channel.close()
            if self._pending is not None and not self.activated.done():
                # The coordinator went away before activating: forget its offer.
                log.info("the coordinator left before activating; waiting for a new one")
                self._pending = None

    def _answer(self, meta: Any) -> AssignmentReply | HelloReply:
        try:
            command = parse_assignment(meta)
        except ValueError as exc:
            rid = meta.get("rid")
            return _refused(rid if type(rid) is int and 0 <= rid < 1 << 63 else 0, str(exc))
        rid = command.rid
        if isinstance(command, Hello):
            return HelloReply(
                rid=rid, version=__version__, cluster=self.z.cluster_name, model=self.identity,
                memory_bytes=host_memory_bytes(), address=self.address,
            )  # fmt: skip
        if isinstance(command, Offer):
            return self._offer(command)
        if isinstance(command, Abort):
            log.warning("the coordinator aborted the assignment: %s", command.reason)
            self._pending = None
            return AssignmentReply(rid=rid, ok=True)
        if self._pending is None:
            return _refused(rid, "no offer")
        if isinstance(command, Commit):
            self._pending.committed = True
            return AssignmentReply(rid=rid, ok=True)
        assert isinstance(command, Activate)
        if not self._pending.committed:
            return _refused(rid, "not committed")
        offer = self._pending.offer
        path = self.z.config_out or Path(".mlxpp") / f"cluster-{offer.node_id}.toml"
        _save_key_beside(self.node_key, path)
        _write(path, offer.topology)
        if not self.activated.done():
            self.activated.set_result((path, offer.node_id))
        return AssignmentReply(rid=rid, ok=True)

    def _offer(self, offer: Offer) -> AssignmentReply:
        refusal = check_offer(
            offer, model=self.identity, version=__version__, cluster=self.z.cluster_name,
            assigned=self._pending is not None or self.activated.done(),
        )  # fmt: skip
        cluster: ClusterConfig | None = None
        if refusal is None:
            try:
                cluster = parse_cluster_config(offer.topology, "the offered cluster TOML")
                node = cluster.find_node(offer.node_id)
                if node is None or node.stage != offer.stage:
                    raise ConfigurationError(f"node {offer.node_id} is not stage {offer.stage}")
                if node.port != parse_address(self.address)[1]:
                    raise ConfigurationError(f"{node.address} is not this peer ({self.address})")
                if cluster.node_roster.key_of(offer.node_id) != self.node_key.public:
                    raise ConfigurationError(
                        f"the offered [roster] does not list this peer's key for {offer.node_id}"
                    )
            except ConfigurationError as exc:
                return _refused(offer.rid, str(exc))
        if refusal is not None:
            reason, message = refusal
            log.error("refusing stage %d: %s", offer.stage, message)
            return _refused(offer.rid, message, reason)
        assert cluster is not None
        self._pending = _Assignment(offer, cluster)
        log.info("accepted stage %d (layers %d-%d)", offer.stage, offer.layers[0],
                 offer.layers[1] - 1)  # fmt: skip
        return AssignmentReply(rid=offer.rid, ok=True)


def _refused(
    rid: int, message: str, reason: RefusalReason = RefusalReason.INVALID_OFFER
) -> AssignmentReply:
    return AssignmentReply(rid=rid, ok=False, reason=reason, message=clip(message, 1000))


async def await_assignment(options: NodeOptions, z: ZeroConfig) -> NodeOptions:
    """Listen on the control address until activated; the options of the assigned stage."""
    secret = _secret(options)
    model_dir = resolve_model_dir(options.model)
    identity = model_identity(model_dir)
    default = "0.0.0.0:0" if z.discovery == "mdns" else None
    control = z.control_addr or default
    if control is None:
        raise ConfigurationError(
            "a --pp-peer with static discovery needs --cluster-control-addr HOST:PORT, the "
            "address the coordinator's --cluster-peers names for this peer",
            source="--cluster-control-addr",
        )
    host, port = _bind_address(control)
    wire = _bringup_wire(z, PEER_ID, COORDINATOR_ID, secret)
    transport = TcpTransport(wire)
    server: PeerServer | None = None

    async def handle(channel: SecureChannel) -> None:
        assert server is not None
        await server.handle(channel)

    listener = await transport.listen(host, port, handle)
    bound_port = listener.address[1]
    address = (
        announce_address(host, bound_port, z.discovery_target)
        if z.discovery == "mdns"
        else f"{host}:{bound_port}"
    )
    server = PeerServer(options, z, identity, address, wire.node_key)
    stop_beacons = asyncio.Event()
    beacons = None
    if z.discovery == "mdns":
        beacons = spawn(
            send_beacons(
                beacon_key(secret.key_bytes()),
                cluster_name=z.cluster_name,
                address=address,
                target=(z.discovery_target, z.discovery_port),
                interval_s=1.0,
                stop=stop_beacons,
            ),  # fmt: skip
            name="beacons",
        )
    log.info("peer %s waiting for its stage assignment (cluster %s)", address, z.cluster_name)
    write_ready(options.ready_file, f"{address}\n")
    try:
        path, node_id = await server.activated
    finally:
        stop_beacons.set()
        await stop_tasks(beacons, cancel=False)
        await listener.close()
    log.info("activated as %s; the cluster TOML is at %s", node_id, path)
    return replace(
        options,
        cluster_file=path,
        node_id=node_id,
        node_key_file=str(key_file_beside(path)),
        ready_file=None,
    )
