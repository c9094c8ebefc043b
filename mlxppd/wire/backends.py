"""Choosing a transport: ``transport_backend`` -> a ``Transport`` instance."""

from __future__ import annotations

from mlxppd.core.config.cluster import ClusterConfig
from mlxppd.core.errors import ConfigurationError
from mlxppd.wire.rdma import RdmaTransport
from mlxppd.wire.secret import ClusterSecret
from mlxppd.wire.stats import WireStats
from mlxppd.wire.tcp import TcpTransport
from mlxppd.wire.thunderbolt import ThunderboltTransport
from mlxppd.wire.transport import Transport, WireConfig

__all__ = ["BACKENDS", "create_transport", "wire_config_for"]

BACKENDS: dict[str, type[Transport]] = {
    "tcp": TcpTransport,
    "thunderbolt": ThunderboltTransport,
    "rdma": RdmaTransport,
}


def create_transport(
    backend: str, config: WireConfig, *, stats: WireStats | None = None
) -> Transport:
    """The transport for ``backend`` (``tcp``, ``thunderbolt`` or ``rdma``)."""
    try:
        cls = BACKENDS[backend]
    except KeyError:
        raise ConfigurationError(
            f"unknown transport backend '{backend}'; use 'tcp', 'thunderbolt' or 'rdma'",
            key="cluster.transport_backend",
        ) from None
    return cls(config, stats=stats)


def wire_config_for(cluster: ClusterConfig, node_id: str, secret: ClusterSecret) -> WireConfig:
    """This node's wire settings from the cluster TOML: only the cluster's nodes may connect."""
    if cluster.find_node(node_id) is None:
        raise ConfigurationError(
            f"node id '{node_id}' is not in the cluster TOML; use one of "
            + ", ".join(n.id for n in cluster.nodes),
            key="--node-id",
        )
    return WireConfig(
        cluster_name=cluster.cluster.name,
        node_id=node_id,
        secret=secret,
        allowed_peers=frozenset(n.id for n in cluster.nodes),
    )
