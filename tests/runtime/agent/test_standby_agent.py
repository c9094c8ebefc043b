"""A standby node's agent: one real ``mlxppd agent`` on loopback starts a worker that holds no
layers, says so in its log and its sd_notify status, and answers an authenticated coordinator's
``Status`` as stage -1; and how the coordinator's status document and the agent's status line
show standbys, idle or serving the stage they adopted."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mlxppd.core.agent.desired import config_generation
from mlxppd.core.agent.plan import StageAddress
from mlxppd.core.config.cluster import load_cluster_config
from mlxppd.core.kv_admission import UNLIMITED_BYTES
from mlxppd.core.protocol.control import StageReport, Status
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.agent.loop import _standby_line
from mlxppd.runtime.agent.status import CoordinatorAdmin, CoordinatorView
from mlxppd.runtime.coordinator.control_client import ControlClient
from mlxppd.runtime.local_cluster import free_port
from mlxppd.wire.backends import create_transport, wire_config_for
from mlxppd.wire.secret import load_cluster_secret
from mlxppd.wire.tasks import stop_tasks
from tests.support.agents import AgentProcess, node_tables, start_local_agent
from tests.support.node_keys import node_key_for, roster_toml, write_agent_key

STANDBY_ID = "standby-0"
CLUSTER = '[cluster]\npipeline_parallel_size = 2\nsecret_file = "cluster.secret"\n\n'
LISTENING = re.compile(
    rf"standby {STANDBY_ID} listening on (?P<host>[0-9.]+):(?P<port>\d+), holding no layers"
)


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "cluster.secret").write_text("standby-test-secret-0123456789\n")
    (etc / "cluster.secret").chmod(0o600)  # a secret readable by others is refused
    nodes = node_tables(*(f"127.0.0.1:{free_port()}" for _ in range(3)))
    standby = f'[[nodes]]\nid = "{STANDBY_ID}"\naddress = "127.0.0.1:{free_port()}"\n'
    roster = roster_toml(["coordinator", "stage-0", "stage-1", STANDBY_ID])
    (etc / "cluster.toml").write_text(f'{CLUSTER}{nodes}\n{standby}role = "standby"\n{roster}')
    write_agent_key(etc, STANDBY_ID)
    # Frequent passes, so the test sees that later ones leave the standby alone.
    (etc / "mlxppd.toml").write_text(f'node_id = "{STANDBY_ID}"\nreconcile_interval_s = 0.2\n')
    return etc


def _wait_for_log(agent: AgentProcess, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while True:
        if (found := pattern.search(agent.log())) is not None:
            return found
        if agent.process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {pattern.pattern!r} in the agent's log:\n{agent.log()}")
        time.sleep(0.2)


async def _status_as_coordinator(config_dir: Path, host: str, port: int) -> StageReport:
    """Connect as the cluster's coordinator (authenticated with the secret) and ask."""
    cluster = load_cluster_config(config_dir / "cluster.toml")
    secret = load_cluster_secret(flag_path=config_dir / "cluster.secret", environ={})
    key = node_key_for("coordinator")
    transport = create_transport("tcp", wire_config_for(cluster, "coordinator", secret, key))
    channel = await transport.connect(host, port, expected_peer=STANDBY_ID)
    control = ControlClient(channel, timeout_s=30)
    reader = asyncio.create_task(control.read_replies())
    try:
        return await control.ask(Status(), StageReport)
    finally:
        await channel.close()
        await stop_tasks(reader, ignore_errors=True)


@pytest.mark.slow
def test_a_standby_agent_serves_an_empty_worker(
    config_dir: Path, cli_env: dict[str, str], embedded_model_dir: Path
) -> None:
    agent = start_local_agent(config_dir, cli_env)
    try:
        found = _wait_for_log(agent, LISTENING, timeout=240)
        ready = agent.notify.wait_for("READY", timeout=60)
        generation = config_generation((config_dir / "cluster.toml").read_bytes())
        assert ready["STATUS"] == f"standby holding no layers, config {generation}"

        host, port = found["host"], int(found["port"])
        report = asyncio.run(_status_as_coordinator(config_dir, host, port))
        assert (report.stage, report.layers, report.parameter_bytes) == (-1, (0, 0), 0)
        assert report.elastic_state == "idle"
        assert report.active_sequences == 0 and report.kv_used_bytes == 0
        # The agent's extras: who it is and which configuration it runs.
        assert (report.node_id, report.config_generation) == (STANDBY_ID, generation)
        # Later reconcile passes (every 0.2 s) neither restart nor stop it.
        time.sleep(2.0)
        log = agent.log()
        assert len(LISTENING.findall(log)) == 1 and log.count("agent: StartStage standby") == 1
        assert "agent: StopStage" not in log
        assert agent.stop() == 0, agent.log()
    finally:
        if agent.process.poll() is None:
            agent.process.kill()
            agent.process.wait(10)
        agent.notify.close()


# -- what status shows ---------------------------------------------------------------------------


def test_the_agent_status_line_of_a_standby() -> None:
    assert _standby_line(None) == "standby holding no layers"
    assert _standby_line(StageSpec.standby(2)) == "standby holding no layers"
    adopted = StageSpec(1, 2, 15, 30)
    assert _standby_line(adopted) == "standby serving stage 1's layers 15-29 (adopted)"


def _report(stage: int, layers: tuple[int, int]) -> StageReport:
    return StageReport.model_construct(
        stage=stage, layers=layers, active_sequences=0, kv_used_bytes=0,
        kv_budget_bytes=UNLIMITED_BYTES, elastic_state="idle", weights="native", blas="none",
        node_id=None, config_generation="g1", last_reload_error=None, memory_budget_bytes=None,
        parameter_bytes=1000,
    )  # fmt: skip


def test_the_status_document_lists_standbys_idle_and_adopted() -> None:
    stages = (StageAddress("stage-0", "10.0.0.2", 1), StageAddress("stage-1", "10.0.0.3", 1))
    standbys = (
        StageAddress("spare-a", "10.0.0.7", 1),  # the coordinator has no link to it
        StageAddress("spare-b", "10.0.0.8", 1),  # linked, still holding nothing
        StageAddress("spare-c", "10.0.0.9", 1),  # took stage 1's layers after stage-1 was lost
    )
    reports = {
        "stage-0": _report(0, (0, 15)),
        "spare-b": _report(-1, (0, 0)),
        "spare-c": _report(1, (15, 30)),
    }

    async def stage_reports() -> dict[str, StageReport]:
        return reports

    # The pipeline as it serves after the failover: stage-1's place taken by spare-c.
    chain = [SimpleNamespace(id="stage-0", host="10.0.0.2", port=1),
             SimpleNamespace(id="spare-c", host="10.0.0.9", port=1)]  # fmt: skip
    live = SimpleNamespace(
        connected=True, waiting=0, stage_reports=stage_reports, link_alive=reports.__contains__,
        chain_nodes=lambda: chain, failovers=[], identity_checks=[], lost_nodes=set(),
        health=lambda: SimpleNamespace(ready=True), transport=SimpleNamespace(backend="tcp"),
    )  # fmt: skip
    gate: Any = SimpleNamespace(coordinator=live, admission="open", in_flight=0)
    view = CoordinatorView(
        cluster_name=lambda: "c", node_id=lambda: "coordinator", gate=lambda: gate,
        stages=lambda: stages, http_address=lambda: "127.0.0.1:8080", driver=lambda: None,
        standbys=lambda: standbys,
    )  # fmt: skip
    document = asyncio.run(CoordinatorAdmin(view).status()).model_dump(mode="json")

    # The stages are the chain serving now (spare-c in the lost stage-1's place), with roles.
    assert [(c["node_id"], c["role"]) for c in document["stages"]] == [
        ("stage-0", "pipeline_stage"),
        ("spare-c", "standby"),
    ]
    cards = {card["node_id"]: card for card in document["stages"] + document["standbys"]}
    assert [c["node_id"] for c in document["standbys"]] == ["spare-a", "spare-b", "spare-c"]
    assert {c["role"] for c in document["standbys"]} == {"standby"}
    shown = ("stage", "layers", "process_alive", "transport_connected", "config_generation")
    assert {n: tuple(cards[n][k] for k in shown) for n in cards} == {
        "stage-0": (0, "0-14", True, True, "g1"),
        "spare-a": (None, None, None, False, None),
        "spare-b": (None, None, True, True, "g1"),
        "spare-c": (1, "15-29", True, True, "g1"),
    }
