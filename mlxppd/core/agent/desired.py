"""From the config files to the agent's desired state: which node this host is, what it runs.

Pure: the caller reads the files and the model's config.json and says which addresses are
local; this module only decides.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from mlxppd.core.agent.plan import (
    AdvertTarget,
    CoordinatorTarget,
    DesiredState,
    StageAddress,
    StageTarget,
)
from mlxppd.core.config.cluster import ClusterConfig, Node, NodeRole
from mlxppd.core.config.host import CLUSTER_FILE, HostSettings, host_tls_files
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import LayerRange, parse_pp_layers
from mlxppd.core.partition.plan import balance_layers
from mlxppd.core.profile.model import profile_from_config
from mlxppd.core.stages import STANDBY_INDEX

__all__ = [
    "cluster_layer_plan",
    "config_generation",
    "desired_state",
    "match_node",
    "tensor_fields",
]


def config_generation(cluster_text: bytes) -> str:
    """Fingerprint of cluster.toml: equal on every host holding the same file."""
    return hashlib.sha256(cluster_text).hexdigest()[:12]


def cluster_layer_plan(cluster: ClusterConfig, config: Mapping[str, Any]) -> tuple[LayerRange, ...]:
    """``[cluster] layers`` when given (validated against the model, adjacency included);
    otherwise the auto partitioner's plan, which every node computes identically."""
    profile = profile_from_config(dict(config))
    if cluster.cluster.layers is not None:
        text = ",".join(cluster.cluster.layers)
        try:
            return parse_pp_layers(text, profile.num_layers, profile.adjacency_groups)
        except ConfigurationError as exc:
            # The parser names the flag; here the ranges came from the file.
            message = str(exc).removeprefix(f"{exc.source}: ") if exc.source else str(exc)
            raise ConfigurationError(message, source=CLUSTER_FILE, key="cluster.layers") from None
    return balance_layers(profile, cluster.cluster.pipeline_parallel_size).ranges


def match_node(
    cluster: ClusterConfig, node_id: str | None, is_local: Callable[[str], bool]
) -> Node:
    """This host's node: ``node_id`` when set, else the one node whose host is local."""
    if node_id is not None:
        node = cluster.find_node(node_id)
        if node is None:
            known = ", ".join(n.id for n in cluster.nodes)
            raise ConfigurationError(
                f"node id '{node_id}' is not in {CLUSTER_FILE} (its nodes: {known}); "
                "fix node_id in mlxppd.toml or --node-id",
                key="node_id",
            )
        return node
    matches = [n for n in cluster.nodes if is_local(n.host)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        hosts = ", ".join(f"{n.id}={n.host}" for n in cluster.nodes)
        raise ConfigurationError(
            f"no node in {CLUSTER_FILE} has an address of this host ({hosts}); "
            "set node_id in mlxppd.toml or pass --node-id",
            key="node_id",
        )
    ids = ", ".join(f"'{n.id}'" for n in matches)
    raise ConfigurationError(
        f"several nodes have addresses of this host ({ids}); "
        "set node_id in mlxppd.toml or pass --node-id to say which one this is",
        key="node_id",
    )


def desired_state(
    cluster: ClusterConfig,
    host: HostSettings,
    node: Node,
    model_config: Mapping[str, Any] | None,
    generation: str,
    *,
    allow_loose: bool = False,
) -> DesiredState:
    """What ``node`` should run under these files (``roles_state``), and its DNS-SD
    advertisement (none where mlxppd.toml turns it off)."""
    desired = roles_state(cluster, host, node, model_config, generation, allow_loose=allow_loose)
    if not host.dnssd_advertise:
        return desired
    advert = AdvertTarget(node.id, cluster.cluster.name, node.host, node.port)
    return replace(desired, advert=advert)


def roles_state(
    cluster: ClusterConfig,
    host: HostSettings,
    node: Node,
    model_config: Mapping[str, Any] | None,
    generation: str,
    *,
    allow_loose: bool = False,
) -> DesiredState:
    """What ``node`` should run under these files: the coordinator, a stage worker, or (a
    standby node) a stage worker holding no layers until the coordinator gives it some.

    ``model_config`` None: this host holds no copy of the model yet. A stage node then runs a
    worker holding no layers that ``mlxppctl prepare`` can ship the model to; the coordinator's
    host holds the cluster's copy, so it cannot be without one. ``allow_loose``: the TLS key
    file may fail the permission rule (--allow-loose-secret-file)."""
    transport = cluster.cluster.transport_backend
    if model_config is None:
        return _awaiting_model(cluster, host, node, generation)
    ranges = cluster_layer_plan(cluster, model_config)
    if node.role is NodeRole.COORDINATOR:
        coordinator = CoordinatorTarget(
            node_id=node.id,
            http_host=host.http_host,
            http_port=host.http_port,
            transport=transport,
            stages=tuple(StageAddress(n.id, n.host, n.port) for n in cluster.pipeline_nodes()),
            layers=ranges,
            parallel=host.parallel,
            max_choices_per_request=host.max_choices_per_request,
            micro_batch_size=host.micro_batch_size,
            prompt_cache_entries=host.prompt_cache_entries,
            prefill_chunk_size=host.prefill_chunk_size,
            api_key=host.api_key,
            cors_origins=host.cors_origins,
            tls=host_tls_files(host, allow_loose=allow_loose),
        )
        return DesiredState(
            node.id,
            generation,
            cluster.cluster.elastic,
            coordinator=coordinator,
            roster=cluster.node_roster,
        )
    index = STANDBY_INDEX
    layers: LayerRange | None = None  # a standby's come from the coordinator, not the files
    if node.role is not NodeRole.STANDBY:
        assert node.stage is not None  # the cluster model guarantees it for stage nodes
        index, layers = node.stage, ranges[node.stage]
    stage = StageTarget(
        node_id=node.id,
        stage=index,
        num_stages=len(ranges),
        layers=layers,
        host=node.host,
        port=node.port,
        transport=transport,
        kv_budget_bytes=host.kv_budget_bytes or cluster.cluster.kv_budget_bytes,
        cpu_weights=host.cpu_weights or cluster.cluster.cpu_weights,
        max_sequences=host.max_sequences,
        **tensor_fields(cluster, node),
    )
    return DesiredState(
        node.id, generation, cluster.cluster.elastic, stage=stage, roster=cluster.node_roster
    )


def tensor_fields(cluster: ClusterConfig, node: Node) -> dict[str, Any]:
    """A 2D node's place in its stage's ring, as ``StageTarget``'s ``tp_*`` fields (nothing
    for a pipeline-only cluster)."""
    if cluster.cluster.tensor_parallel_size <= 1 or node.stage is None:
        return {}
    ranks = cluster.nodes_at_stage(node.stage)
    return {
        "tp_rank": node.tp_rank,
        "tp_ring": tuple(n.ring_address for n in ranks),
        "tp_nodes": tuple(n.id for n in ranks),
        "tp_addresses": tuple(n.address for n in ranks),
    }


def _awaiting_model(
    cluster: ClusterConfig, host: HostSettings, node: Node, generation: str
) -> DesiredState:
    if node.role is NodeRole.COORDINATOR:
        raise ConfigurationError(
            "the coordinator's host holds the cluster's copy of the model, and this host has "
            "none; put the model directory here (or fix the path)",
            source="mlxppd.toml",
            key="model",
        )
    stage = StageTarget(
        node_id=node.id,
        stage=STANDBY_INDEX,
        num_stages=len(cluster.pipeline_nodes()),
        layers=None,
        host=node.host,
        port=node.port,
        transport=cluster.cluster.transport_backend,
        awaiting_model=True,
    )
    return DesiredState(
        node.id, generation, cluster.cluster.elastic, stage=stage, roster=cluster.node_roster
    )
