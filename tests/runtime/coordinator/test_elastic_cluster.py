"""Elastic repartitioning on a live three-process cluster (agents on loopback).

Under a steady stream of requests an explicit repartition completes; every answer, before,
during (after a Retry-After) and after, equals single-process mlx-lm's; a drain that times out
ends in Failed with the old ranges serving; memory pressure fires once per cool-down.

Nothing here races the wall clock: each step waits (with a generous deadline) for the state
it needs, and the cool-down is either far longer than the test or zero.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxppd.core.agent.desired import config_generation
from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.runtime.local_cluster import free_port
from tests.support.agents import (
    AgentProcess,
    node_tables,
    start_local_agent,
    start_ready_agents,
    wait_for_status,
    write_agent_dirs,
    write_cluster_toml,
)
from tests.support.ctl_runner import CtlRunner
from tests.support.node_keys import roster_toml
from tests.support.references import greedy_answers, served_weights

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "List three colors.",
    "What is 2 + 2?",
]
LONG = "Tell me a story about a dragon."
#: tokens of a short answer (to QUESTIONS) and of the long one (to LONG)
SHORT_N, LONG_N = 8, 24
#: clients sending requests back to back while a repartition runs
CLIENTS = 2
#: the memory-pressure test's KV budget per stage: a LONG request fills ~59% of it
KV_BUDGET = 2_431_000

#: the agents' nodes, each with its config directory (holding its node.key)
NODES = ("coordinator", "stage-0", "stage-1")

CLUSTER = """\
[cluster]
name = "elastic-test"
pipeline_parallel_size = 2
secret_file = "{secret}"
{extra}

[cluster.elastic]
enabled = true
drain_timeout_s = {drain}
pressure_fraction = {fraction}
cool_down_s = {cool_down}

# A restarted agent reloads the model before it listens again: wait for it.
[cluster.failover]
reconnect_grace_s = 300

"""


@pytest.fixture(scope="module")
def reference(embedded_model_dir: Path) -> dict[tuple[str, int], str]:
    return greedy_answers(embedded_model_dir, [*((q, SHORT_N) for q in QUESTIONS), (LONG, LONG_N)])


class Cluster:
    def __init__(self, root: Path, config_dirs: list[Path], ports: list[int], http: int):
        self.root, self.config_dirs, self.ports = root, config_dirs, ports
        self.agents: list[AgentProcess] = []
        self.env: dict[str, str] = {}
        self.url = f"http://127.0.0.1:{http}"
        self.secret = root / "cluster.secret"
        self.generation = ""
        #: runs the mlxppctl commands, one process for all of them
        self.runner = CtlRunner()

    def write(self, *, drain: float = 60.0, fraction: float = 0.92, cool_down: float = 30.0,
              extra: str = "") -> None:  # fmt: skip
        text = CLUSTER.format(
            secret=self.secret, extra=extra, drain=drain, fraction=fraction, cool_down=cool_down,
        ) + "\n" + node_tables(*(f"127.0.0.1:{p}" for p in self.ports))  # fmt: skip
        text += roster_toml(NODES)
        write_cluster_toml(self.config_dirs, text)
        self.generation = config_generation(text.encode())

    def wait_applied(self, timeout: float = 120) -> dict[str, Any]:
        """Until every agent has the cluster.toml written last in force (policy included: an
        agent sets the generation after everything the file describes)."""
        return self.wait_status(
            lambda d: (
                d["coordinator"]["config_generation"] == self.generation
                and all(s["config_generation"] == self.generation for s in d["stages"])
            ),
            timeout,
        )

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``mlxppctl *args`` for the coordinator's config directory."""
        return self.runner.ctl(*args, "--config-dir", str(self.config_dirs[0]))

    def status(self) -> dict[str, Any]:
        done = self.ctl("status", "--json")
        assert done.returncode in (0, 1), done.stderr
        document: dict[str, Any] = json.loads(done.stdout)
        return document

    def wait_status(self, predicate: Any, timeout: float = 120) -> dict[str, Any]:
        return wait_for_status(self.status, predicate, timeout)

    def chat(self, question: str, max_tokens: int = SHORT_N) -> httpx.Response:
        body = {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=300)

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value from the coordinator's /metrics (0 when not exported yet)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(f"{name}{{") and all(
                f'{k}="{v}"' in line for k, v in labels.items()
            ):
                return float(line.split()[-1])
        return 0.0


def answer_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path, model_cache: Path
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("elastic")
    (root / "cluster.secret").write_text("elastic-test-secret-0123456789abcdef\n")
    (root / "cluster.secret").chmod(0o600)
    ports = [free_port() for _ in range(3)]
    http = free_port()
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    running = Cluster(root, [root / node for node in NODES], ports, http)
    running.env = env
    try:
        write_agent_dirs(
            running.config_dirs,
            NODES,
            f'node_id = "{{node}}"\nhttp_port = {http}\nreconcile_interval_s = 1.0\n',
        )
        running.write()
        running.agents = start_ready_agents(running.config_dirs, env)
        yield running
    finally:
        for agent in running.agents:
            agent.stop(timeout=30)
        running.runner.close()


def test_explicit_repartition_under_steady_load(
    cluster: Cluster, reference: dict[tuple[str, int], str]
) -> None:
    stop = threading.Event()
    answers: list[tuple[str, str]] = []
    refused: list[str] = []
    errors: list[str] = []

    def client(offset: int) -> None:
        i = offset
        while not stop.is_set():
            question = QUESTIONS[i % len(QUESTIONS)]
            response = cluster.chat(question)
            if response.status_code == 503:
                # A refusal during the drain: retry the same request after Retry-After.
                refused.append(response.json()["error"]["code"])
                time.sleep(float(response.headers["Retry-After"]))
                continue
            if response.status_code != 200:
                errors.append(response.text)
                return
            answers.append((question, answer_of(response)))
            i += 1

    # Two clients back to back: the repartition drains what they have in flight (at most
    # one each), and each is then refused (503) until it completes.
    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        while len(answers) < CLIENTS and not errors:
            time.sleep(0.2)
        before = len(answers)
        done = cluster.ctl("repartition", "--pp-layers", "0-9,10-29", "--wait")
        assert done.returncode == 0, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == "repartition accepted: draining"
        assert [line.split(" (")[0] for line in lines[1:]] == [
            "idle -> draining",
            "draining -> rebalancing",
            "rebalancing -> resuming",
            "resuming -> idle",
        ]
        assert "layers in force 0-9,10-29" in lines[-1]
        deadline = time.monotonic() + 120
        # What the drain let finish, then at least as many again on the new layers.
        while len(answers) < before + 2 * CLIENTS and not errors and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert not errors, errors
    assert len(answers) >= before + 2 * CLIENTS
    for question, text in answers:
        assert text == reference[(question, SHORT_N)], (question, text)
    assert refused and set(refused) <= {"admission_closed"}, refused

    document = cluster.status()
    assert [s["layers"] for s in document["stages"]] == ["0-9", "10-29"]
    assert document["coordinator"]["elastic_state"] == "idle"
    event = document["coordinator"]["last_repartition_event"]
    assert (event["outcome"], event["trigger"]) == ("completed", "explicit")
    loads = document["coordinator"]["last_repartition_loads"]
    # Stage 0 only dropped layers 10-14: it read nothing. Stage 1 read only layers 10-14.
    assert loads[0]["loaded_tensors"] == 0
    per_layer = loads[1]["loaded_tensors"] // 5
    assert loads[1]["loaded_tensors"] == 5 * per_layer > 0
    assert loads[1]["reused_tensors"] > loads[1]["loaded_tensors"]
    assert (
        cluster.metric("mlxpp_pp_repartition_events_total", trigger="explicit", outcome="completed")
        == 1.0
    )


def test_the_partitioner_plans_when_no_layers_are_given(
    cluster: Cluster, reference: dict[tuple[str, int], str]
) -> None:
    done = cluster.ctl("repartition", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "layers in force 0-14,15-29" in done.stdout.splitlines()[-1]
    assert answer_of(cluster.chat(QUESTIONS[0])) == reference[(QUESTIONS[0], SHORT_N)]


def test_a_bad_plan_is_refused_before_anything_drains(cluster: Cluster) -> None:
    done = cluster.ctl("repartition", "--pp-layers", "0-40,41-50")
    assert done.returncode == 1
    assert "refused (invalid_plan)" in done.stderr and "30 layers" in done.stderr
    assert cluster.status()["coordinator"]["elastic_state"] == "idle"


def test_memory_budgets_are_checked_at_the_weights_the_stages_hold(
    cluster: Cluster, embedded_model_dir: Path, reference: dict[tuple[str, int], str]
) -> None:
    """Stage 0 with layers 0-4 needs ~40 MiB in 4-bit weights but ~175 MiB in float32: a
    100 MiB budget fits the one and not the other, and the plan is priced as the stages report
    holding their weights."""
    float32 = served_weights(embedded_model_dir) is CpuWeights.FLOAT32
    assert {s["weights"] for s in cluster.status()["stages"]} == {
        "float32" if float32 else "native"
    }
    done = cluster.ctl(
        "repartition", "--pp-layers", "0-4,5-29", "--stage-memory", "100MiB,400MiB", "--wait"
    )
    last = done.stdout.splitlines()[-1]
    if float32:
        assert done.returncode == 1, done.stdout
        assert "over its budget of 104857600" in last and "layers in force 0-14,15-29" in last
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "layers in force 0-4,5-29" in last
        assert cluster.ctl("repartition", "--pp-layers", "0-14,15-29", "--wait").returncode == 0
    assert [s["layers"] for s in cluster.status()["stages"]] == ["0-14", "15-29"]
    assert answer_of(cluster.chat(QUESTIONS[1])) == reference[(QUESTIONS[1], SHORT_N)]


def test_drain_timeout_fails_and_the_old_ranges_keep_serving(
    cluster: Cluster, reference: dict[tuple[str, int], str]
) -> None:
    # A drain of 0.1 s: the long request is still in flight when it runs out.
    cluster.write(drain=0.1)
    cluster.wait_applied()
    result: dict[str, Any] = {}
    long = threading.Thread(target=lambda: result.update(r=cluster.chat(LONG, LONG_N)))
    long.start()
    cluster.wait_status(lambda d: any(s["in_flight"] for s in d["stages"]), timeout=60)
    done = cluster.ctl("repartition", "--pp-layers", "0-4,5-29", "--wait")
    long.join(300)
    assert done.returncode == 1, done.stdout
    last = done.stdout.splitlines()[-1]
    assert last.startswith("draining -> failed (aborted)"), last
    assert "layers in force 0-14,15-29" in last and "drain_timeout_s" in last
    # The long request was never cut off, and the old ranges still answer.
    assert answer_of(result["r"]) == reference[(LONG, LONG_N)]
    document = cluster.status()
    assert document["coordinator"]["elastic_state"] == "failed"
    assert [s["layers"] for s in document["stages"]] == ["0-14", "15-29"]
    assert document["coordinator"]["admission"] == "open"
    assert answer_of(cluster.chat(QUESTIONS[1])) == reference[(QUESTIONS[1], SHORT_N)]
    # Only an explicit trigger leaves Failed.
    cluster.write(drain=60.0)
    cluster.wait_applied()
    assert cluster.ctl("repartition", "--wait").returncode == 0


def test_memory_pressure_fires_once_per_cool_down(
    cluster: Cluster, reference: dict[tuple[str, int], str]
) -> None:
    """Runs right after an explicit repartition, so a cool-down is already running.

    The cool-down is either an hour (it cannot run out during the test) or zero (it has run
    out for sure), so the outcome never depends on how fast this machine is.
    """
    fired = {"trigger": "memory_pressure", "outcome": "completed"}
    waits = "waits for the cool-down"

    def fired_count() -> float:
        return cluster.metric("mlxpp_pp_repartition_events_total", **fired)

    def configure(cool_down: float) -> None:
        # A LONG_N-token request (62 tokens with its prompt) fills more than half of a
        # stage's KV budget (~59%, 23 KiB a token on 15 float32 layers). A drain of 600 s only
        # bounds how long a repartition may wait for the request in flight.
        cluster.write(
            drain=600.0, fraction=0.5, cool_down=cool_down, extra=f"kv_budget_bytes = {KV_BUDGET}"
        )
        document = cluster.wait_applied()
        assert all(s["kv_budget_bytes"] == KV_BUDGET for s in document["stages"]), document

    def pressure_until(seen: Any, what: str, deadline_s: float = 300) -> None:
        """Send long requests (each under pressure while it runs; the coordinator looks
        every second) until ``seen()``; a 503 means a repartition closed admission."""
        deadline = time.monotonic() + deadline_s
        while not seen():
            assert time.monotonic() < deadline, f"no {what} within {deadline_s} s"
            response = cluster.chat(LONG, LONG_N)
            if response.status_code == 503:
                continue
            assert answer_of(response) == reference[(LONG, LONG_N)]

    def pressure_event(d: dict[str, Any]) -> bool:
        event = d["coordinator"]["last_repartition_event"] or {}
        return event.get("trigger") == "memory_pressure"

    # An hour's cool-down from the last repartition: pressure is seen and waits.
    configure(cool_down=3600.0)
    refusals = cluster.agents[0].log().count(waits)
    pressure_until(lambda: cluster.agents[0].log().count(waits) > refusals, "refusal")
    assert fired_count() == 0.0
    assert not pressure_event(cluster.status())

    # No cool-down: the same pressure fires, once (nothing is sent once it has fired).
    configure(cool_down=0.0)
    pressure_until(lambda: pressure_event(cluster.status()), "repartition")
    document = cluster.wait_status(
        lambda d: pressure_event(d) and d["coordinator"]["elastic_state"] in ("idle", "failed"),
        timeout=300,
    )
    event = document["coordinator"]["last_repartition_event"]
    assert (event["outcome"], document["coordinator"]["elastic_state"]) == ("completed", "idle")
    assert fired_count() == 1.0

    # An hour's cool-down again, from that repartition: the pressure waits, it does not fire.
    configure(cool_down=3600.0)
    refusals = cluster.agents[0].log().count(waits)
    pressure_until(lambda: cluster.agents[0].log().count(waits) > refusals, "refusal")
    assert fired_count() == 1.0
    assert cluster.status()["coordinator"]["elastic_state"] == "idle"


def test_a_restarted_stage_brings_the_cluster_back_to_the_files_ranges(
    cluster: Cluster, reference: dict[tuple[str, int], str]
) -> None:
    done = cluster.ctl("repartition", "--pp-layers", "0-19,20-29", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert cluster.agents[2].stop(timeout=60) == 0
    cluster.agents[2] = start_local_agent(cluster.config_dirs[2], cluster.env)
    cluster.agents[2].notify.wait_for("READY", timeout=300)
    # The coordinator reconnects and moves stage 0 back to the file's 0-14 before admitting.
    cluster.wait_status(
        lambda d: (
            [s["layers"] for s in d["stages"]] == ["0-14", "15-29"] and d["health"] == "healthy"
        ),
        timeout=120,
    )
    assert "moved the stages back to the planned layers" in cluster.agents[0].log()
    assert answer_of(cluster.chat(QUESTIONS[2])) == reference[(QUESTIONS[2], SHORT_N)]
