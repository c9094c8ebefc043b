"""Zero-config bring-up, the coordinator's side: from resolved peers to a cluster TOML.

Zero-config startup (docs/zero-config.md): ``--pp-auto N`` with peers from ``--cluster-peers``
or from discovery beacons. Peers are sorted by their textual address before anything else (the
determinism contract), so the same set of peers always gives the same ``ClusterConfig`` and,
through ``render_cluster_toml``, the same bytes. The result goes through the same validation as
a hand-written TOML, so the runtime cannot tell the two apart.

Also here: the ``--dry-run`` topology summary and the checks whose failure makes a dry run exit
non-zero. Nothing in this module touches the network; callers pass in what they observed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxppd.core.config.addresses import address_key, split_host_port
from mlxppd.core.config.cluster import ClusterConfig, ClusterSection, Node, NodeRole, parse_address
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.partition.plan import PartitionPlan, balance_layers, format_bytes
from mlxppd.core.profile.model import ModelProfile

__all__ = [
    "COORDINATOR_ID",
    "DEFAULT_DISCOVERY_PORT",
    "PeerInfo",
    "dry_run_problems",
    "peer_notes",
    "plan_cluster",
    "sort_peers",
    "stage_node_id",
    "topology_summary",
]

COORDINATOR_ID = "coordinator"
#: the default ``--cluster-discovery-port``
DEFAULT_DISCOVERY_PORT = 49555

_PEERS = "--cluster-peers"
_PP_AUTO = "--pp-auto"
_CONTROL = "--cluster-control-addr"
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


@dataclass(frozen=True)
class PeerInfo:
    """One ``--pp-peer`` as the coordinator knows it before planning."""

    #: "host:port" of the peer's control socket, as given in --cluster-peers or announced
    address: str
    #: the memory the peer reported for weights; None when it did not say
    memory_bytes: int | None = None
    #: False when the peer did not answer (a dry run still plans it)
    reachable: bool = True

    def __post_init__(self) -> None:
        if self.memory_bytes is not None and self.memory_bytes < 0:
            raise ValueError(f"peer {self.address} reported negative memory")


def stage_node_id(stage: int) -> str:
    """The node id zero-config gives the peer serving ``stage``."""
    return f"stage-{stage}"


def sort_peers(peers: Sequence[PeerInfo]) -> list[PeerInfo]:
    """Peers in stage order: lexicographic by address text; a repeated address is an error."""
    seen: dict[tuple[str, int], str] = {}
    for peer in peers:
        try:
            key = address_key(peer.address)
        except ValueError as exc:
            raise ConfigurationError(f"{exc}; fix that peer address", source=_PEERS) from None
        if key in seen:
            again = peer.address if seen[key] == peer.address else f"{seen[key]} / {peer.address}"
            raise ConfigurationError(
                f"peer address {again} is given twice; each --pp-peer needs its own host:port, "
                "so remove the repeated entry",
                source=_PEERS,
            )
        seen[key] = peer.address
    return sorted(peers, key=lambda p: p.address)


def _too_few_peers(resolved: int, want: int, discovery_port: int) -> str:
    return (
        f"{resolved} peers resolved, {_PP_AUTO} {want} needs {want}; add peers to {_PEERS}, "
        f"check that every --pp-peer is running and that UDP port {discovery_port} is open, "
        "or use static discovery (--cluster-discovery static with --cluster-peers)"
    )


def _budgets(peers: Sequence[PeerInfo]) -> list[int | None] | None:
    """Per-stage memory budgets: a peer that did not report is planned with the known mean."""
    known = [p.memory_bytes for p in peers if p.memory_bytes is not None]
    if not known:
        return None
    mean = sum(known) // len(known)
    return [p.memory_bytes if p.memory_bytes is not None else mean for p in peers]


def peer_notes(peers: Sequence[PeerInfo]) -> list[str]:
    """Summary notes for the peers whose memory the plan had to guess."""
    known = [p.memory_bytes for p in peers if p.memory_bytes is not None]
    guess = (
        f"planned with the mean reported memory ({format_bytes(sum(known) // len(known))})"
        if known
        else "planned with equal memory"
    )
    notes = []
    for peer in sorted(peers, key=lambda p: p.address):
        if peer.memory_bytes is None:
            why = "did not answer" if not peer.reachable else "did not report its memory"
            notes.append(f"peer {peer.address} {why}; {guess}")
    return notes


def plan_cluster(
    *,
    name: str,
    control_addr: str,
    peers: Sequence[PeerInfo],
    num_stages: int,
    profile: ModelProfile,
    discovery_port: int = DEFAULT_DISCOVERY_PORT,
    transport_backend: str = "tcp",
) -> ClusterConfig:
    """The cluster ``--pp-auto num_stages`` brings up: the coordinator at ``control_addr``, then
    one stage per peer in sorted address order, layers balanced over the peers' memory.

    Reported memory is a budget (a stage never gets more than its peer holds), not a weight: the
    balancer evens out the stage loads within the budgets, so layers move toward a bigger peer
    only when a smaller one cannot hold its even share. Raises ConfigurationError with the fix.
    """
    ordered = _checked_peers(control_addr, peers, num_stages, profile, discovery_port)
    plan = _plan_over(profile, num_stages, ordered)
    nodes = [Node(id=COORDINATOR_ID, address=control_addr, role=NodeRole.COORDINATOR)]
    nodes += [
        Node(id=stage_node_id(i), address=p.address, role=NodeRole.PIPELINE_STAGE, stage=i)
        for i, p in enumerate(ordered)
    ]
    section = ClusterSection(
        name=name,
        pipeline_parallel_size=num_stages,
        transport_backend=transport_backend,
        layers=[str(r) for r in plan.ranges],
    )
    return ClusterConfig(cluster=section, nodes=nodes)


def _checked_peers(
    control_addr: str,
    peers: Sequence[PeerInfo],
    num_stages: int,
    profile: ModelProfile,
    discovery_port: int,
) -> list[PeerInfo]:
    """The peers in stage order, once the request and the peers make a cluster."""
    try:
        parse_address(control_addr)
    except ValueError as exc:
        raise ConfigurationError(
            f"{exc}; give the coordinator's control address as host:port", source=_CONTROL
        ) from None
    if num_stages < 2:
        raise ConfigurationError(
            f"{num_stages} stages requested; zero-config pipelines need at least 2 "
            "(serve a single process without --pp-auto)",
            source=_PP_AUTO,
        )
    if num_stages > profile.num_layers:
        raise ConfigurationError(
            f"{num_stages} stages requested but the model has {profile.num_layers} layers; "
            f"use a {_PP_AUTO} of at most {profile.num_layers}",
            source=_PP_AUTO,
        )
    ordered = sort_peers(peers)
    if len(ordered) < num_stages:
        raise ConfigurationError(_too_few_peers(len(ordered), num_stages, discovery_port))
    if len(ordered) > num_stages:
        extra = ordered[num_stages:]
        raise ConfigurationError(
            f"{len(ordered)} peers resolved but {_PP_AUTO} {num_stages} takes exactly "
            f"{num_stages}; drop {', '.join(p.address for p in extra)} from {_PEERS} "
            f"(or stop those --pp-peer processes), or use {_PP_AUTO} {len(ordered)}",
            source=_PEERS,
        )
    control_key = address_key(control_addr)
    for peer in ordered:
        if address_key(peer.address) == control_key:
            raise ConfigurationError(
                f"peer {peer.address} is the coordinator's own control address; give "
                f"{_CONTROL} another port or remove it from {_PEERS}",
                source=_CONTROL,
            )
    return list(ordered)


def _plan_over(
    profile: ModelProfile, num_stages: int, ordered: Sequence[PeerInfo]
) -> PartitionPlan:
    """Layers balanced over the peers, within the memory each reported."""
    budgets = _budgets(ordered)
    try:
        plan = balance_layers(profile, num_stages, budgets)
    except ConfigurationError as exc:
        if budgets is None:
            raise
        reported = ", ".join(
            f"{stage_node_id(i)} {p.address}: {format_bytes(b or 0)}"
            for i, (p, b) in enumerate(zip(ordered, budgets, strict=True))
        )
        raise ConfigurationError(
            f"the model does not fit the memory the peers reported ({reported}); free memory "
            f"on the peers, add peers and raise {_PP_AUTO}, or use a more strongly quantized "
            f"model (balancer: {exc})",
            source=_PP_AUTO,
        ) from None
    return plan


def topology_summary(cluster: ClusterConfig, toml_path: str, notes: Sequence[str] = ()) -> str:
    """The ``--dry-run`` summary (docs/zero-config.md), without a trailing newline."""
    c = cluster.cluster
    nodes = [cluster.coordinator, *cluster.stage_nodes()]
    lines = [
        f"Cluster: {c.name}",
        f"  TP size: {c.tensor_parallel_size}, PP size: {c.pipeline_parallel_size}",
        f"  Nodes ({len(nodes)}):",
        *(f"    - {n.id} @ {n.address} [{n.role.value}]" for n in nodes),
    ]
    if c.layers is not None:
        lines.append(f"  Layers: {', '.join(c.layers)}")
    lines += [f"  note: {note}" for note in notes]
    lines.append(f"Emitted cluster TOML at: {toml_path}")
    return "\n".join(lines)


def _split_bind(address: str) -> tuple[str, int] | None:
    """(host, port) of a bind address, wildcards allowed, the host lower-cased."""
    split = split_host_port(address)
    return (split[0].lower(), split[1]) if split is not None else None


def _same_socket(a: str, b: str) -> bool:
    """Would binding ``a`` and ``b`` collide? A wildcard host collides with any host."""
    left, right = _split_bind(a), _split_bind(b)
    if left is None or right is None or left[1] != right[1]:
        return False
    return left[0] == right[0] or left[0] in _WILDCARDS or right[0] in _WILDCARDS


def dry_run_problems(
    *,
    num_stages: int,
    peers_resolved: int,
    control_addr: str,
    http_addr: str,
    bound_ports: Sequence[str],
    discovery_port: int = DEFAULT_DISCOVERY_PORT,
) -> list[str]:
    """Why ``--dry-run`` must exit non-zero, one actionable sentence each; empty when none.

    ``http_addr`` is "--host:--port"; ``bound_ports`` lists the addresses this coordinator would
    bind (control and HTTP) that another process already holds, as the caller found by probing.
    """
    problems = []
    if peers_resolved < num_stages:
        problems.append(_too_few_peers(peers_resolved, num_stages, discovery_port))
    if _same_socket(control_addr, http_addr):
        problems.append(
            f"the control address {control_addr} collides with the HTTP listen address "
            f"{http_addr}; change {_CONTROL} or --port so they differ"
        )
    for address in bound_ports:
        if _same_socket(address, control_addr):
            flag = _CONTROL
        elif _same_socket(address, http_addr):
            flag = "--port"
        else:
            flag = f"{_CONTROL} or --port"
        problems.append(
            f"{address} is already bound by another process; change {flag} or stop the "
            "process holding that port"
        )
    return problems
