"""Three hosts, three agents: each in its own network namespace with its own address, each
reading its own config directory holding the same cluster.toml (and no node id: every agent
finds its node by its address). The cluster answers like single-process mlx-lm, follows a
rewritten cluster.toml without a restart, survives a broken one, and drains on SIGTERM."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxppd.engine.blas import blas_in_use
from tests.support.adapters import adapted_answers, random_adapter
from tests.support.agents import (
    CHAT,
    STREAM_AND_SIGNAL,
    VENV_BIN,
    AgentProcess,
    Hosts,
    in_host_python,
    netns_unavailable,
    node_tables,
    start_agent,
    wait_for_status,
)
from tests.support.node_keys import roster_toml, write_agent_key
from tests.support.references import greedy_answers, served_weights

pytestmark = pytest.mark.slow

_WHY = netns_unavailable()
if _WHY is not None:
    pytest.skip(f"three-host agent tests need network namespaces: {_WHY}", allow_module_level=True)

QUESTION = "What is the capital of France?"
SECOND = "Tell me a story about a dragon."
HTTP_PORT = 8080
#: the node each host is (its config directory holds that node's key, node.key)
HOST_NODES = ("coordinator", "stage-0", "stage-1")
#: greedy tokens per answer compared with mlx-lm's (a parity check needs no more)
TOKENS = 8

CLUSTER = """\
[cluster]
name = "netns-test"
pipeline_parallel_size = 2
secret_file = "{secret}"
{layers}

"""


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Path:
    """A per-request adapter over the last 20 layers (both stages hold some of it)."""
    return random_adapter(embedded_model_dir, tmp_path_factory.mktemp("tuned"), num_layers=20)


@pytest.fixture(scope="module")
def reference(embedded_model_dir: Path, tuned: Path) -> dict[str, str]:
    """Single-process mlx-lm's greedy answers (TOKENS tokens; "tuned": with the adapter)."""
    answers = greedy_answers(embedded_model_dir, [(q, TOKENS) for q in (QUESTION, SECOND)])
    out = {q: answer for (q, _), answer in answers.items()}
    tuned_answers = adapted_answers(embedded_model_dir, tuned, [(QUESTION, TOKENS)])
    out["tuned"] = tuned_answers[(QUESTION, TOKENS)]
    assert out["tuned"] != out[QUESTION]  # not vacuous
    return out


class Cluster:
    def __init__(self, hosts: Hosts, root: Path, agents: list[AgentProcess], adapter: Path):
        self.hosts, self.root, self.agents, self.adapter = hosts, root, agents, adapter
        self.url = f"http://{hosts.addresses[0]}:{HTTP_PORT}"

    def write_cluster(self, text: str) -> None:
        """Rewrite cluster.toml on every host, as a config-management tool would."""
        for agent in self.agents:
            tmp = agent.config_dir / "cluster.toml.tmp"
            tmp.write_text(text)
            os.replace(tmp, agent.config_dir / "cluster.toml")

    def chat(
        self, question: str, max_tokens: int = TOKENS, model: str | None = None
    ) -> dict[str, Any]:
        args = [question, str(max_tokens), *([model] if model else [])]
        result: dict[str, Any] = in_host_python(self.hosts, 0, CHAT, self.url, *args)
        return result

    def status(self) -> dict[str, Any]:
        """`mlxppctl status --json`, run on the coordinator host from its config directory."""
        done = self.hosts.run(
            0,
            str(VENV_BIN / "mlxppctl"), "status", "--json",
            "--config-dir", str(self.agents[0].config_dir),
        )  # fmt: skip
        assert done.returncode in (0, 1), done.stderr
        document: dict[str, Any] = json.loads(done.stdout)
        return document

    def wait_status(self, predicate: Any, timeout: float = 180) -> dict[str, Any]:
        def logs() -> str:
            return "\n".join(a.log()[-3000:] for a in self.agents)

        return wait_for_status(self.status, predicate, timeout, logs)


def cluster_text(hosts: Hosts, secret: Path, adapter: Path, layers: str = "") -> str:
    a0, a1, a2 = hosts.addresses
    nodes = node_tables(f"{a0}:19000", f"{a1}:19001", f"{a2}:19001")
    # A per-request adapter from the TOML, as the agent reads it (docs/adapters.md).
    adapters = f'\n[[adapters]]\nname = "tuned"\npath = "{adapter}"\n'
    roster = roster_toml(HOST_NODES)
    return CLUSTER.format(secret=secret, layers=layers) + "\n" + nodes + adapters + roster


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, tuned: Path, model_cache: Path
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("agents")
    secret = root / "cluster.secret"
    secret.write_text("netns-test-secret-0123456789abcdef\n")
    secret.chmod(0o600)
    hosts = Hosts.create(3)
    agents: list[AgentProcess] = []
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    try:
        text = cluster_text(hosts, secret, tuned)
        for i in range(3):
            config_dir = root / f"host{i}" / "etc"
            config_dir.mkdir(parents=True)
            (config_dir / "cluster.toml").write_text(text)
            write_agent_key(config_dir, HOST_NODES[i])
            (config_dir / "mlxppd.toml").write_text(
                f'http_host = "0.0.0.0"\nhttp_port = {HTTP_PORT}\nreconcile_interval_s = 2.0\n'
                f'drain_timeout_s = 60.0\nstate_dir = "{root / f"host{i}"}"\n'
            )
        for i in (1, 2, 0):
            agents.append(start_agent(hosts, i, root / f"host{i}" / "etc", env))
        agents.sort(key=lambda a: a.host)
        for agent in agents:
            try:
                agent.notify.wait_for("READY", timeout=300)
            except AssertionError:
                raise AssertionError(agent.log()[-4000:]) from None
        yield Cluster(hosts, root, agents, tuned)
    finally:
        for agent in agents:
            agent.stop(timeout=30)
        hosts.destroy()


def test_agents_find_their_nodes_and_answer_like_mlx_lm(
    cluster: Cluster, reference: dict[str, str]
) -> None:
    ready = [a.notify.wait_for("READY", timeout=1) for a in cluster.agents]
    assert "coordinator of 2 stages" in ready[0]["STATUS"]
    assert "stage 0 serving layers 0-14" in ready[1]["STATUS"]
    assert "stage 1 serving layers 15-29" in ready[2]["STATUS"]
    answer = cluster.chat(QUESTION)
    assert answer["status"] == 200, answer
    assert answer["body"]["choices"][0]["message"]["content"] == reference[QUESTION]
    tuned = cluster.chat(QUESTION, model="tuned")
    assert tuned["body"]["choices"][0]["message"]["content"] == reference["tuned"], tuned


def test_status_shows_every_stage(cluster: Cluster, embedded_model_dir: Path) -> None:
    document = cluster.status()
    assert document["health"] == "healthy", document
    generation = document["coordinator"]["config_generation"]
    assert [s["node_id"] for s in document["stages"]] == ["stage-0", "stage-1"]
    for stage, layers, host in zip(document["stages"], ["0-14", "15-29"], (1, 2), strict=True):
        assert stage["layers"] == layers
        assert stage["address"] == f"{cluster.hosts.addresses[host]}:19001"
        assert stage["process_alive"] and stage["transport_connected"]
        assert stage["config_generation"] == generation
        assert stage["last_reload_error"] is None
        # The stage's own account of how it computes (the fast CPU path where it applies).
        assert stage["weights"] == str(served_weights(embedded_model_dir))
        assert stage["blas"] == str(blas_in_use())


def test_every_agent_advertises_itself_on_dns_sd(cluster: Cluster) -> None:
    secret = str(cluster.root / "cluster.secret")
    argv = [str(VENV_BIN / "mlxppctl"), "discover", "--json", "--cluster-name", "netns-test",
            "--cluster-secret-file", secret, "--timeout", "3"]  # fmt: skip
    for _ in range(5):  # multicast DNS answers in a second or two: allow a retry
        done = cluster.hosts.run(1, *argv, timeout=60)
        seen = json.loads(done.stdout) if done.stdout else {"nodes": []}
        if len(seen["nodes"]) == len(HOST_NODES):
            break
    assert done.returncode == 0, done.stderr
    assert [n["node_id"] for n in seen["nodes"]] == sorted(HOST_NODES)
    for node in seen["nodes"]:
        host = HOST_NODES.index(node["node_id"])
        assert cluster.hosts.addresses[host] in node["addresses"], node
        assert node["accelerator"] == "cpu" and node["free_memory_bytes"] > 0
    assert seen["ignored"] == {}


def test_new_layer_ranges_reconcile_without_restart(
    cluster: Cluster, reference: dict[str, str]
) -> None:
    pids = [a.process.pid for a in cluster.agents]
    secret = cluster.root / "cluster.secret"
    cluster.write_cluster(
        cluster_text(cluster.hosts, secret, cluster.adapter, 'layers = ["0-9", "10-29"]')
    )

    def moved(d: dict[str, Any]) -> bool:
        return [s["layers"] for s in d["stages"]] == ["0-9", "10-29"] and d["health"] == "healthy"

    document = cluster.wait_status(moved)
    generation = document["coordinator"]["config_generation"]
    assert all(s["config_generation"] == generation for s in document["stages"])
    assert [a.process.pid for a in cluster.agents] == pids
    assert all(a.process.poll() is None for a in cluster.agents), "an agent restarted"
    for question in (QUESTION, SECOND):
        answer = cluster.chat(question)
        assert answer["status"] == 200, answer
        assert answer["body"]["choices"][0]["message"]["content"] == reference[question]
    # The stages moved their layers and kept the adapter, re-read for the layers they gained.
    tuned = cluster.chat(QUESTION, model="tuned")
    assert tuned["body"]["choices"][0]["message"]["content"] == reference["tuned"], tuned
    log = cluster.agents[1].log()
    assert "ReloadStage stage 0 layers 0-9" in log and "now serves layers 0-9" in log


def test_broken_cluster_toml_keeps_serving_and_shows_the_error(
    cluster: Cluster, reference: dict[str, str]
) -> None:
    before = cluster.status()
    good = (cluster.agents[0].config_dir / "cluster.toml").read_text()
    cluster.write_cluster(good.replace("pipeline_parallel_size = 2", "pipeline_paralel_size = 2"))

    def failed(d: dict[str, Any]) -> bool:
        stage_errors = [s["last_reload_error"] for s in d["stages"]]
        return bool(d["coordinator"]["last_reload_error"]) and all(stage_errors)

    document = cluster.wait_status(failed, timeout=60)
    error = document["coordinator"]["last_reload_error"]
    assert "cluster.toml" in error and "pipeline_paralel_size" in error and "line 3" in error
    assert "did you mean 'pipeline_parallel_size'" in error
    assert document["health"] == "degraded"
    assert document["coordinator"]["reload_failures"] >= 1
    # Still the previous configuration, still serving.
    same = before["coordinator"]["config_generation"]
    assert document["coordinator"]["config_generation"] == same
    answer = cluster.chat(QUESTION)
    assert answer["status"] == 200, answer
    assert answer["body"]["choices"][0]["message"]["content"] == reference[QUESTION]
    metrics = in_host_python(
        cluster.hosts,
        0,
        "import httpx, json, sys; print(json.dumps(httpx.get(sys.argv[1] + '/metrics').text))",
        cluster.url,
    )
    line = next(
        x for x in metrics.splitlines() if x.startswith("mlxpp_config_reload_failures_total")
    )
    assert float(line.split()[-1]) >= 1
    # A good file clears the error.
    cluster.write_cluster(good)
    cluster.wait_status(lambda d: d["health"] == "healthy", timeout=60)


def test_drain_and_resume_stop_and_restart_admission(
    cluster: Cluster, reference: dict[str, str]
) -> None:
    def ctl(command: str) -> str:
        done = cluster.hosts.run(
            0,
            str(VENV_BIN / "mlxppctl"), command,
            "--config-dir", str(cluster.agents[0].config_dir),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "draining" in ctl("drain")
    refused = cluster.chat(QUESTION)
    assert refused["status"] == 503, refused
    assert refused["body"]["error"]["code"] == "admission_closed"
    assert refused["retry_after"] == "2"
    document = cluster.status()
    assert document["coordinator"]["admission"] == "draining"
    assert document["health"] == "degraded"
    assert "open" in ctl("resume")
    answer = cluster.chat(QUESTION)
    assert answer["status"] == 200, answer
    assert answer["body"]["choices"][0]["message"]["content"] == reference[QUESTION]


def test_sigterm_during_a_stream_finishes_it_then_exits_zero(
    cluster: Cluster, reference: dict[str, str]
) -> None:
    """Runs last: SIGTERM to the coordinator and a stage as the first token arrives."""
    coordinator, stage = cluster.agents[0], cluster.agents[2]
    mark = len(coordinator.notify.messages)
    result = in_host_python(
        cluster.hosts,
        0,
        STREAM_AND_SIGNAL,
        cluster.url,
        QUESTION,
        str(TOKENS),
        f"{coordinator.process.pid},{stage.process.pid}",
    )
    assert result["signalled"] and result["done"], result
    assert result["text"] == reference[QUESTION]
    assert coordinator.process.wait(90) == 0, coordinator.log()[-3000:]
    assert stage.process.wait(90) == 0, stage.log()[-3000:]
    assert "STOPPING" in coordinator.notify.wait_for("STOPPING", timeout=1, after=mark)
