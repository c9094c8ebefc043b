"""Choosing a transport: ``transport_backend`` -> a ``Transport`` instance."""

from __future__ import annotations

from mlxppd.core.config.cluster import ClusterConfig
from mlxppd.core.errors import ConfigurationError
from mlxppd.wire.channel import RekeyPolicy
from mlxppd.wire.node_key import NodeKey, check_own_key
from mlxppd.wire.rdma import RdmaTransport
from mlxppd.wire.roster_book import RosterBook
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


def wire_config_for(
    cluster: ClusterConfig,
    node_id: str,
    secret: ClusterSecret,
    node_key: NodeKey,
    roster: RosterBook | None = None,
) -> WireConfig:
    """This node's wire settings from the cluster TOML: the nodes its ``[roster]`` lists may
    connect. ``roster``: the node's shared book (an agent's, replaced on reload); None: one of
    this cluster's own. A key the roster does not list for ``node_id`` is refused here."""
    if cluster.find_node(node_id) is None:
        raise ConfigurationError(
            f"node id '{node_id}' is not in the cluster TOML; use one of "
            + ", ".join(n.id for n in cluster.nodes),
            key="--node-id",
        )
    check_own_key(cluster.node_roster, node_id, node_key, source="the cluster TOML")
    section = cluster.cluster
    return WireConfig(
        cluster_name=section.name,
        node_id=node_id,
        secret=secret,
        node_key=node_key,
        roster=roster if roster is not None else RosterBook(cluster.node_roster),
        rekey=RekeyPolicy(section.rekey_after_records, section.rekey_after_s),
    )
