"""The cluster TOML's cross-node invariants: one coordinator, every (stage, rank) slot filled
once, unique ids and addresses, tensor-parallel rings that fit. ``ClusterConfig`` runs
``check_topology`` when it is built, so later layers trust a loaded cluster without checking
again."""

from __future__ import annotations

from collections.abc import Sequence

from mlxppd.core.config.addresses import address_key
from mlxppd.core.config.messages import KeyedValueError
from mlxppd.core.config.nodes import Node
from mlxppd.core.config.roles import NodeRole

__all__ = ["check_topology"]


def check_topology(nodes: Sequence[Node], pp: int, tp: int) -> None:
    """Every cross-node invariant; raises KeyedValueError at the first problem, in node order."""
    seen_ids: dict[str, int] = {}
    seen_addresses: dict[tuple[str, int], int] = {}
    coordinators: list[int] = []
    slots: dict[tuple[int, int], int] = {}
    for i, node in enumerate(nodes):
        _check_unique(nodes, i, seen_ids, seen_addresses)
        if node.role in (NodeRole.COORDINATOR, NodeRole.STANDBY):
            _check_stageless(nodes, i, coordinators)
            continue
        slot = _stage_slot(node, i, pp, tp)
        if slot in slots:
            other = nodes[slots[slot]].id
            key = "stage" if tp == 1 else "rank"
            where = f"stage {node.stage}" if tp == 1 else f"(stage {slot[0]}, rank {slot[1]})"
            what = "each stage" if tp == 1 else "each (stage, rank) pair"
            raise KeyedValueError(
                ("nodes", i, key),
                f"{where} appears on nodes '{other}' and '{node.id}'; give {what} exactly one node",
            )
        slots[slot] = i
    if tp > 1:
        _check_rings(nodes)
    if not coordinators:
        raise KeyedValueError(
            ("nodes",),
            "no node has role 'hybrid'; add one coordinator node with role = \"hybrid\"",
        )
    _check_complete(slots, pp, tp)


def _check_rings(nodes: Sequence[Node]) -> None:
    """Every rank's ring address is its own: no other rank's, no node's transport address."""
    taken = {address_key(n.address): n.id for n in nodes}
    for i, node in enumerate(nodes):
        if node.role is not NodeRole.PIPELINE_TENSOR_PARALLEL:
            continue
        if node.tp_address is None and node.port == 65535:
            raise KeyedValueError(
                ("nodes", i, "tp_address"),
                f"node '{node.id}' listens on port 65535, so there is no port after it for its "
                "tensor-parallel ring; set tp_address to a free host:port",
            )
        canon = address_key(node.ring_address)
        if canon in taken:
            how = "its tp_address" if node.tp_address else "the port after its address"
            raise KeyedValueError(
                ("nodes", i, "tp_address"),
                f"node '{node.id}' would join its tensor-parallel ring on {node.ring_address} "
                f"({how}), which node '{taken[canon]}' uses already; set tp_address to a free "
                "host:port",
            )
        taken[canon] = node.id


def _check_unique(
    nodes: Sequence[Node],
    i: int,
    seen_ids: dict[str, int],
    seen_addresses: dict[tuple[str, int], int],
) -> None:
    """Node ``i``'s id and address are not used by an earlier node (records them)."""
    node = nodes[i]
    if node.id in seen_ids:
        raise KeyedValueError(
            ("nodes", i, "id"),
            f"node id '{node.id}' is used by nodes[{seen_ids[node.id]}] and nodes[{i}]; "
            "give each node a unique id",
        )
    seen_ids[node.id] = i
    # Hostnames are case-insensitive; IPv6 spellings are compared in canonical form.
    canon = address_key(node.address)
    if canon in seen_addresses:
        other = nodes[seen_addresses[canon]].id
        raise KeyedValueError(
            ("nodes", i, "address"),
            f"address '{node.address}' is used by nodes '{other}' and '{node.id}'; "
            "give each node its own host:port",
        )
    seen_addresses[canon] = i


def _check_stageless(nodes: Sequence[Node], i: int, coordinators: list[int]) -> None:
    """The coordinator (one per cluster, recorded) or a standby: no stage or rank key."""
    node = nodes[i]
    if node.role is NodeRole.COORDINATOR and coordinators:
        other = nodes[coordinators[0]].id
        raise KeyedValueError(
            ("nodes", i, "role"),
            f"nodes '{other}' and '{node.id}' both have role 'hybrid'; a cluster has "
            "exactly one coordinator, so give the others role 'pipeline_stage'",
        )
    if node.role is NodeRole.COORDINATOR:
        coordinators.append(i)
        what = f"the coordinator '{node.id}' runs no stage"
    else:
        what = (
            f"node '{node.id}' is a standby, which serves no stage of its own until the "
            "coordinator gives it a lost stage's layers"
        )
    for key in ("stage", "rank", "tp_address"):
        if getattr(node, key) is not None:
            raise KeyedValueError(("nodes", i, key), f"{what}; remove its {key} key")


def _stage_slot(node: Node, i: int, pp: int, tp: int) -> tuple[int, int]:
    """The (stage, rank) a stage node fills, once its role, stage and rank are consistent."""
    name = f"'{node.id}'"
    if node.role is NodeRole.PIPELINE_TENSOR_PARALLEL and tp == 1:
        raise KeyedValueError(
            ("nodes", i, "role"),
            f"node {name} has role 'pipeline_tensor_parallel' but tensor_parallel_size is 1; "
            "set cluster.tensor_parallel_size above 1 or use role 'pipeline_stage'",
        )
    if node.role is NodeRole.PIPELINE_STAGE and tp > 1:
        raise KeyedValueError(
            ("nodes", i, "role"),
            f"node {name} has role 'pipeline_stage' but tensor_parallel_size is {tp}; "
            "in a 2D cluster every stage node has role 'pipeline_tensor_parallel' and a rank",
        )
    if node.stage is None:
        raise KeyedValueError(
            ("nodes", i, "stage"), f"node {name} has no stage; set stage to one of 0..{pp - 1}"
        )
    if node.stage >= pp:
        raise KeyedValueError(
            ("nodes", i, "stage"),
            f"node {name} has stage {node.stage} but pipeline_parallel_size is {pp}; "
            f"use a stage from 0 to {pp - 1}",
        )
    if tp == 1:
        if node.tp_address is not None:
            raise KeyedValueError(
                ("nodes", i, "tp_address"),
                f"node {name} has role 'pipeline_stage', which joins no tensor-parallel ring; "
                "remove tp_address, or set cluster.tensor_parallel_size for a 2D cluster",
            )
        if node.rank is not None:
            raise KeyedValueError(
                ("nodes", i, "rank"),
                f"node {name} has role 'pipeline_stage', which has no tensor-parallel rank; "
                "remove rank, or set cluster.tensor_parallel_size for a 2D cluster",
            )
        return node.stage, 0
    if node.rank is None:
        raise KeyedValueError(
            ("nodes", i, "rank"), f"node {name} has no rank; set rank to one of 0..{tp - 1}"
        )
    if node.rank >= tp:
        raise KeyedValueError(
            ("nodes", i, "rank"),
            f"node {name} has rank {node.rank} but tensor_parallel_size is {tp}; "
            f"use a rank from 0 to {tp - 1}",
        )
    return node.stage, node.rank


def _check_complete(slots: dict[tuple[int, int], int], pp: int, tp: int) -> None:
    """Every (stage, rank) of the pp x tp grid has its node."""
    missing = [(s, r) for s in range(pp) for r in range(tp) if (s, r) not in slots]
    if not missing:
        return
    if tp == 1:
        names = ", ".join(str(s) for s, _ in missing)
        subject = f"stage {names} has" if len(missing) == 1 else f"stages {names} have"
        raise KeyedValueError(
            ("nodes",),
            f"{subject} no node; pipeline_parallel_size = {pp} needs one "
            f"'pipeline_stage' node for each stage 0..{pp - 1}",
        )
    names = ", ".join(f"(stage {s}, rank {r})" for s, r in missing)
    raise KeyedValueError(
        ("nodes",),
        f"{len(slots)} 'pipeline_tensor_parallel' nodes but pipeline_parallel_size x "
        f"tensor_parallel_size = {pp * tp}; add nodes for {names}",
    )
