"""Choosing a backend by ``transport_backend``, and the Thunderbolt backend's rules."""

from __future__ import annotations

import sys

import pytest

from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.errors import ConfigurationError
from mlxppd.wire.backends import BACKENDS, create_transport, wire_config_for
from mlxppd.wire.rdma import RdmaTransport
from mlxppd.wire.tcp import TcpTransport
from mlxppd.wire.thunderbolt import ThunderboltTransport, bridge_addresses
from mlxppd.wire.transport import Transport
from tests.support.node_keys import node_key_for, roster_for, roster_toml
from tests.support.wire import SECRET, config, run

pytestmark = pytest.mark.timeout(30)

MACOS_IFCONFIG = """\
lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384
\tinet 127.0.0.1 netmask 0xff000000
en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 192.168.1.20 netmask 0xffffff00 broadcast 192.168.1.255
en1: flags=8963<UP,BROADCAST,SMART,RUNNING,PROMISC,SIMPLEX,MULTICAST> mtu 1500
\tmedia: autoselect <full-duplex>
bridge0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\toptions=63<RXCSUM,TXCSUM,TSO4,TSO6>
\tinet 10.10.0.1 netmask 0xffffff00 broadcast 10.10.0.255
\tConfiguration:
\t\tid 0:0:0:0:0:0 priority 0 hellotime 0 fwddelay 0
\tmember: en1 flags=3<LEARNING,DISCOVER>
\t        ifmaxaddr 0 port 7 priority 0 path cost 0
\tmember: en2 flags=3<LEARNING,DISCOVER>
\tstatus: active
bridge1: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 169.254.3.7 netmask 0xffff0000
\tmember: en3 flags=3<LEARNING,DISCOVER>
bridge2: flags=8863<UP> mtu 1500
\tinet 10.20.0.1 netmask 0xffffff00
"""

CLUSTER_TOML = """\
[cluster]
name = "pp"
pipeline_parallel_size = 2
transport_backend = "rdma"

[[nodes]]
id = "coordinator"
address = "127.0.0.1:19000"
role = "hybrid"

[[nodes]]
id = "stage-0"
address = "127.0.0.1:19001"
role = "pipeline_stage"
stage = 0

[[nodes]]
id = "stage-1"
address = "127.0.0.1:19002"
role = "pipeline_stage"
stage = 1
""" + roster_toml(["coordinator", "stage-0", "stage-1"])


@pytest.mark.parametrize(("name", "cls"), [("tcp", TcpTransport), ("rdma", RdmaTransport)])
def test_each_backend_name_makes_its_transport(name: str, cls: type[Transport]) -> None:
    transport = create_transport(name, config("n"))
    assert type(transport) is cls and transport.backend == name
    assert set(BACKENDS) == {"tcp", "thunderbolt", "rdma"}


def test_an_unknown_backend_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="'tcp', 'thunderbolt' or 'rdma'"):
        create_transport("infiniband", config("n"))


@pytest.mark.skipif(sys.platform == "darwin", reason="the off-macOS rule")
def test_thunderbolt_off_macos_says_to_use_tcp_or_rdma() -> None:
    with pytest.raises(ConfigurationError) as error:
        create_transport("thunderbolt", config("n"))
    message = str(error.value)
    assert "macOS" in message and '"tcp"' in message and '"rdma"' in message
    assert error.value.key == "cluster.transport_backend"


def test_the_thunderbolt_bridge_is_a_bridge_with_members_and_a_routable_ipv4() -> None:
    assert bridge_addresses(MACOS_IFCONFIG) == [("bridge0", "10.10.0.1")]
    assert bridge_addresses("") == []


def test_thunderbolt_without_a_routable_bridge_refuses_to_listen() -> None:
    unconfigured = MACOS_IFCONFIG.replace("inet 10.10.0.1", "inet 169.254.9.9")
    transport = ThunderboltTransport(
        config("n"), platform_name="darwin", ifconfig=lambda: unconfigured
    )

    async def scenario() -> None:
        with pytest.raises(ConfigurationError, match="routable IPv4"):
            await transport.listen("0.0.0.0", 0, lambda channel: None)  # type: ignore[arg-type,return-value]

    run(scenario)
    other = ThunderboltTransport(
        config("n"), platform_name="darwin", ifconfig=lambda: MACOS_IFCONFIG
    )
    assert other.bridge_address() == "10.10.0.1"

    async def wrong_host() -> None:
        with pytest.raises(ConfigurationError, match="not the Thunderbolt Bridge address"):
            await other.listen("192.168.1.20", 0, lambda channel: None)  # type: ignore[arg-type,return-value]

    run(wrong_host)


def test_the_cluster_toml_gives_the_backend_the_name_the_roster_and_the_rekey_defaults() -> None:
    cluster = parse_cluster_config(CLUSTER_TOML, "cluster.toml")
    wire = wire_config_for(cluster, "stage-0", SECRET, node_key_for("stage-0"))
    assert wire.cluster_name == "pp" and wire.node_id == "stage-0"
    assert wire.roster.current == roster_for(["coordinator", "stage-0", "stage-1"])
    assert (wire.rekey.after_records, wire.rekey.after_s) == (2**24, 120.0)
    assert type(create_transport(cluster.cluster.transport_backend, wire)) is RdmaTransport
    with pytest.raises(ConfigurationError, match="not in the cluster TOML"):
        wire_config_for(cluster, "stage-7", SECRET, node_key_for("stage-7"))
    # Another node's key file: refused at start, not at every handshake later.
    with pytest.raises(ConfigurationError, match="is not node stage-0's key"):
        wire_config_for(cluster, "stage-0", SECRET, node_key_for("stage-1"))
