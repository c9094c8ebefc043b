"""Revoking a node by its roster line, on a live cluster of three real ``mlxppd agent``
processes on loopback (a coordinator, two stages, each with its own config directory and its
own ``node.key``).

A host holding the cluster secret but not stage-1's key cannot be stage-1: stage-0 refuses it
and counts the refusal. The operator removes stage-1's line from ``[roster]`` in every host's
cluster.toml; the agents reload it on the file change. From then on stage-1 is refused, and the
links it holds close at once (not at a heartbeat timeout): the coordinator's status shows it
disconnected, its metrics count the closed channel and the refused handshakes. Putting the line
back lets it in again.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.runtime.local_cluster import free_port
from mlxppd.wire.backends import create_transport, wire_config_for
from mlxppd.wire.errors import HandshakeError, HandshakeFailure
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.secret import ClusterSecret
from mlxppd.wire.transport import WireConfig
from tests.support.agents import (
    AgentProcess,
    node_tables,
    start_ready_agents,
    wait_for_status,
    write_agent_dirs,
    write_cluster_toml,
)
from tests.support.ctl_runner import CtlRunner
from tests.support.node_keys import node_key_for, roster_toml, without_roster_line

pytestmark = pytest.mark.slow

NODES = ("coordinator", "stage-0", "stage-1")
SECRET = "roster-revocation-secret-0123456789"
#: the coordinator's heartbeat interval; its timeout is far longer (30 s), so a link that goes
#: down within one interval was closed by the revocation itself
HEARTBEAT_S = 1.0
CLUSTER = """\
[cluster]
name = "revocation"
pipeline_parallel_size = 2
secret_file = "{secret}"

[cluster.failover]
heartbeat_interval_s = {heartbeat}
heartbeat_timeout_s = 30.0
reconnect_grace_s = 600.0

"""


class Cluster:
    def __init__(self, root: Path, ports: list[int], http: int) -> None:
        self.root, self.ports = root, ports
        self.config_dirs = [root / node for node in NODES]
        self.url = f"http://127.0.0.1:{http}"
        self.agents: list[AgentProcess] = []
        self.reader = CtlRunner()
        nodes = node_tables(*(f"127.0.0.1:{p}" for p in ports))
        self.text = (
            CLUSTER.format(secret=root / "cluster.secret", heartbeat=HEARTBEAT_S)
            + nodes
            + roster_toml(NODES)
        )

    def write(self, text: str) -> None:
        """Rewrite cluster.toml on every host, as a config-management tool would."""
        write_cluster_toml(self.config_dirs, text)

    def status(self) -> dict[str, Any]:
        done = self.reader.ctl("status", "--json", "--config-dir", str(self.config_dirs[0]))
        assert done.returncode in (0, 1), done.stderr
        document: dict[str, Any] = json.loads(done.stdout)
        return document

    def wait_status(self, predicate: Any, timeout: float = 120) -> dict[str, Any]:
        return wait_for_status(self.status, predicate, timeout, self.logs)

    def metric(self, name: str) -> float:
        """Counter ``name`` from the coordinator's /metrics, summed over its labels."""
        text = self.reader.get(f"{self.url}/metrics")
        pattern = re.compile(rf"^{name}_total(\{{[^}}]*\}})? (\S+)$", re.M)
        return sum(float(value) for _, value in pattern.findall(text))

    def logs(self) -> str:
        return "\n".join(
            f"--- {n}\n{a.log()[-3000:]}" for n, a in zip(NODES, self.agents, strict=False)
        )

    def chat(self) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120)


def logged_at(log: str, text: str) -> datetime:
    """When the first line of ``log`` holding ``text`` was written."""
    line = next((x for x in log.splitlines() if text in x), None)
    assert line is not None, f"no {text!r} in:\n{log}"
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


def wait_log(agent: AgentProcess, after: int, text: str, timeout: float = 60) -> None:
    """Until ``agent``'s log, past offset ``after``, holds ``text``."""
    deadline = time.monotonic() + timeout
    while text not in agent.log()[after:]:
        assert time.monotonic() < deadline, f"no {text!r} in:\n{agent.log()[-3000:]}"
        time.sleep(0.2)


def connected(document: dict[str, Any]) -> dict[str, bool]:
    return {s["node_id"]: bool(s["transport_connected"]) for s in document["stages"]}


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, chat_llama: Path, model_cache: Path
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("revocation")
    (root / "cluster.secret").write_text(SECRET + "\n")
    (root / "cluster.secret").chmod(0o600)
    http = free_port()
    running = Cluster(root, [free_port() for _ in NODES], http)
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    env.pop("MLXPP_NODE_KEY_FILE", None)  # each agent reads the node.key of its config dir
    try:
        write_agent_dirs(
            running.config_dirs,
            NODES,
            f'node_id = "{{node}}"\nmodel = "{chat_llama}"\nhttp_port = {http}\n'
            "reconcile_interval_s = 1.0\n",
        )
        running.write(running.text)
        running.agents = start_ready_agents(running.config_dirs, env)
        yield running
    finally:
        for agent in running.agents:
            agent.stop(timeout=30)
        running.reader.close()


async def handshake_as(node: str, text: str, port: int) -> None:
    """Connect to the stage listening on ``port`` as ``node``, holding ``node``'s own key and
    the cluster secret (``text``: a cluster TOML that still lists it)."""
    cluster = parse_cluster_config(text, "cluster.toml")
    config = wire_config_for(
        cluster, node, ClusterSecret(SECRET.encode(), "test"), node_key_for(node)
    )
    channel = await create_transport("tcp", config).connect(
        "127.0.0.1", port, expected_peer="stage-0"
    )
    await channel.close()


async def impersonate(node: str, text: str, port: int) -> None:
    """Connect to the stage on ``port`` claiming to be ``node``, with the cluster secret but a
    key of its own (what a host that stole the secret, not ``node``'s key, could do)."""
    cluster = parse_cluster_config(text, "cluster.toml")
    config = WireConfig(
        cluster.cluster.name,
        node,
        ClusterSecret(SECRET.encode(), "test"),
        NodeKey.generate("the impostor's key"),
        RosterBook(cluster.node_roster),
    )
    channel = await create_transport("tcp", config).connect("127.0.0.1", port)
    await channel.close()


def test_a_node_claiming_another_nodes_id_is_refused_and_counted(cluster: Cluster) -> None:
    failures_before = cluster.metric("mlxpp_transport_handshake_failures")
    with pytest.raises(HandshakeError) as refused:
        asyncio.run(impersonate("stage-1", cluster.text, cluster.ports[1]))
    assert refused.value.reason == HandshakeFailure.PEER_REJECTED_PROOF
    # Stage 0 counted it (its reports reach the coordinator's /metrics) and logged it.
    deadline = time.monotonic() + 60
    while cluster.metric("mlxpp_transport_handshake_failures") <= failures_before:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
    wait_log(cluster.agents[1], 0, "(node 'stage-1') failed authentication")
    # The real stage-1 keeps its links; the cluster still serves.
    assert connected(cluster.status()) == {"stage-0": True, "stage-1": True}
    assert cluster.chat().status_code == 200


def test_a_removed_roster_line_refuses_the_node_and_closes_its_links(cluster: Cluster) -> None:
    assert connected(cluster.status()) == {"stage-0": True, "stage-1": True}
    assert cluster.chat().status_code == 200
    revoked_before = cluster.metric("mlxpp_transport_revoked_channels")
    failures_before = cluster.metric("mlxpp_transport_handshake_failures")
    marks = [len(a.log()) for a in cluster.agents]

    cluster.write(without_roster_line(cluster.text, "stage-1"))
    cluster.wait_status(lambda d: not connected(d)["stage-1"], timeout=60)
    coordinator_log = cluster.agents[0].log()[marks[0] :]
    # Closed on the roster change, within one heartbeat of it (a timeout would take 30 s).
    updated = logged_at(coordinator_log, "agent: UpdateRoster 2 node keys")
    closed = logged_at(coordinator_log, "closing the channel to node 'stage-1'")
    lost = logged_at(coordinator_log, "lost stage 1 (stage-1)")
    # The roster change itself closes the link (the close is part of UpdateRoster, logged in
    # order with it), not a missed heartbeat: that is what "within one heartbeat" means here,
    # without timing the machine.
    assert updated <= closed <= lost, coordinator_log
    assert "its key is no longer in the roster" in coordinator_log
    assert "sent nothing for" not in coordinator_log
    # Stage 0 closes its own link to stage-1 too; stage-1's agent refuses the file that no
    # longer lists it, and says why.
    wait_log(cluster.agents[1], marks[1], "closing the channel to node 'stage-1'")
    wait_log(cluster.agents[2], marks[2], "stage-1 is not in [roster]")

    # From then on stage-1 is refused: its own key and the secret no longer get it in.
    with pytest.raises(HandshakeError):
        asyncio.run(handshake_as("stage-1", cluster.text, cluster.ports[1]))
    # The coordinator counts the closed channel; its reconnects to stage-1 fail the handshake.
    assert cluster.metric("mlxpp_transport_revoked_channels") >= revoked_before + 1
    deadline = time.monotonic() + 60
    while cluster.metric("mlxpp_transport_handshake_failures") <= failures_before:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
    assert cluster.status()["health"] != "healthy"

    # The line back: stage-1 is let in again and the cluster serves.
    cluster.write(cluster.text)
    cluster.wait_status(lambda d: all(connected(d).values()) and d["health"] == "healthy", 180)
    assert cluster.chat().status_code == 200
