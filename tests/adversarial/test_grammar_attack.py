"""Schemas made to be slow to compile, against a live cluster that notices a silent stage fast.

Three ``mlxppd serve --distributed-config`` processes (a coordinator and two stages of the chat
llama, which speaks through the embedded model's tokenizer) whose ``[cluster.failover]`` counts
a stage lost after 2 s without a heartbeat. The attack: four requests at once, each of ``n=16``
choices constrained by a schema of its own just under the 64 KiB bound, an ``anyOf`` of 950
date-time strings, the first constrained requests since the stages started (so the last stage
also loads its tokenizer). Each is answered (or refused naming the compile limit), no stage is
lost, and a normal request afterwards is answered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxppd.core.protocol.sampling import MAX_SCHEMA_BYTES
from mlxppd.runtime.local_cluster import free_port
from mlxppd.wire.secret import write_new_secret
from tests.support.node_keys import add_roster, write_node_keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NODES = ("coordinator", "stage-0", "stage-1")
MESSAGES = [{"role": "user", "content": "When did it happen? Answer with a date and time."}]
CLUSTER = """\
[cluster]
name = "grammar-attack"
pipeline_parallel_size = 2

[cluster.failover]
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 2.0

[[nodes]]
id = "coordinator"
address = "127.0.0.1:{coordinator}"
role = "hybrid"

[[nodes]]
id = "stage-0"
address = "127.0.0.1:{stage0}"
role = "pipeline_stage"
stage = 0

[[nodes]]
id = "stage-1"
address = "127.0.0.1:{stage1}"
role = "pipeline_stage"
stage = 1
"""


@dataclass
class TomlCluster:
    url: str
    procs: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]

    def log(self, node: str) -> str:
        return self.logs[node].read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def cluster(
    chat_llama: Path, tmp_path_factory: pytest.TempPathFactory, model_cache: Path
) -> Iterator[TomlCluster]:
    tmp = tmp_path_factory.mktemp("grammar-attack")
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    config = tmp / "cluster.toml"
    ports = {"coordinator": free_port(), "stage0": free_port(), "stage1": free_port()}
    config.write_text(CLUSTER.format(**ports))
    add_roster(config, NODES)
    keys = write_node_keys(tmp / "keys", NODES)
    secret = tmp / "cluster.secret"
    write_new_secret(secret)
    http_port = free_port()
    procs, logs = {}, {}
    for node in NODES:
        cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve",
               "--distributed-config", str(config), "--node-id", node, "--model", str(chat_llama),
               "--cluster-secret-file", str(secret),
               "--node-key-file", str(keys[node])]  # fmt: skip
        if node == "coordinator":
            cmd += ["--port", str(http_port), "--ready-file", str(tmp / "coordinator.ready")]
            # The attack's 4 x 16 choices, allowed on purpose (the defaults refuse n=16, and
            # keep an eighth of --parallel from any one client).
            cmd += ["--max-choices-per-request", "16", "--parallel", "80"]
        logs[node] = tmp / f"{node}.log"
        with logs[node].open("wb") as out:
            procs[node] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    running = TomlCluster(f"http://127.0.0.1:{http_port}", procs, logs)
    deadline = time.monotonic() + 240
    while not (tmp / "coordinator.ready").exists():
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            running.stop()
            raise RuntimeError(f"{dead or 'nothing'} exited:\n" + running.log((dead or NODES)[0]))
        time.sleep(0.1)
    yield running
    running.stop()


def date_time_schema(tag: int) -> dict[str, Any]:
    """An anyOf of 950 date-time strings, each described apart so that no two schemas (and no
    two alternatives) are the same: 56 KiB of compact JSON, under the 64 KiB bound."""
    alternatives = [
        {"type": "string", "format": "date-time", "description": f"{tag}-{i:03d}"}
        for i in range(950)
    ]
    return {"anyOf": alternatives}


def ask(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def test_slow_schemas_in_n_choices_lose_no_stage_and_a_normal_request_is_answered(
    cluster: TomlCluster,
) -> None:
    schemas = [date_time_schema(tag) for tag in range(4)]
    for schema in schemas:
        # Compact, as the stage compiles it; as the HTTP layer forwards it, under the bound.
        size = len(json.dumps(schema, separators=(",", ":")).encode())
        assert 55 * 1024 < size and len(json.dumps(schema)) < MAX_SCHEMA_BYTES, size
    bodies = [
        {"messages": MESSAGES, "max_tokens": 8, "n": 16, "temperature": 1.0, "seed": tag,
         "response_format": {"type": "json_schema",
                             "json_schema": {"name": f"moment{tag}", "schema": schema}}}
        for tag, schema in enumerate(schemas)
    ]  # fmt: skip
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        answers = list(pool.map(lambda body: ask(cluster.url, body), bodies))
    for answer in answers:
        if answer.status_code == 400:  # refused as too slow to compile: named, not a failover
            assert "grammar compile limit" in answer.json()["error"]["message"], answer.text
        else:
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["choices"]) == 16
    probe = ask(cluster.url, {"messages": MESSAGES, "max_tokens": 8, "temperature": 0})
    assert probe.status_code == 200, probe.text
    log = cluster.log("coordinator")
    assert "sent nothing for" not in log and "failover:" not in log, log[-3000:]
    assert "no word from the coordinator" not in cluster.log("stage-1")
