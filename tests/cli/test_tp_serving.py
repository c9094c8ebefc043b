"""Serving with tensor-parallel stages (2D PP x TP): real stage processes joined by MLX's ring
backend on loopback, rank 0 of each stage on the encrypted transport, the others following it.

The model is ``chat_llama`` (tests/conftest.py: a tiny llama, 4 heads and 2 KV heads, so it
shards over 2 ranks, that speaks through the embedded model's tokenizer, so the chat API serves
it); its greedy text is compared with single-process mlx-lm's on the same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxppd.runtime.local_cluster import free_port
from mlxppd.wire.secret import write_new_secret
from tests.support.node_keys import roster_toml, write_node_keys
from tests.support.references import greedy_answers
from tests.support.tp_serving import QUESTION

pytestmark = pytest.mark.slow

#: s1-r1's KV budget: room for the short request, not for a long one
SMALL_BUDGET = 24 * 1024
#: tokens of each answer compared with mlx-lm's
ANSWER_TOKENS = 12


@pytest.fixture(scope="module")
def reference(chat_llama: Path) -> dict[tuple[str, int], str]:
    return greedy_answers(chat_llama, [(QUESTION, ANSWER_TOKENS)])


def chat(url: str, question: str, max_tokens: int) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def cluster_toml(ports: dict[str, int]) -> str:
    lines = [
        "[cluster]", 'name = "tp-2x2"', "pipeline_parallel_size = 2",
        "tensor_parallel_size = 2", "",
        "[[nodes]]", 'id = "coordinator"', f'address = "127.0.0.1:{ports["coordinator"]}"',
        'role = "hybrid"',
    ]  # fmt: skip
    for stage in (0, 1):
        for rank in (0, 1):
            node = f"s{stage}-r{rank}"
            lines += ["", "[[nodes]]", f'id = "{node}"', f'address = "127.0.0.1:{ports[node]}"']
            lines += ['role = "pp_tp"', f"stage = {stage}", f"rank = {rank}"]
            lines += [f'tp_address = "127.0.0.1:{free_port()}"']
    return "\n".join(lines) + "\n" + roster_toml(ports)


@dataclass
class TomlCluster:
    url: str
    secret: Path
    trace: Path
    procs: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]

    def log(self, node: str) -> str:
        return self.logs[node].read_text(errors="replace")

    def stop(self) -> dict[str, int | None]:
        """SIGTERM the coordinator, then the stages' rank 0 (each tells its rank 1 to stop);
        every process's exit status."""
        for node in ("coordinator", "s0-r0", "s1-r0"):
            self.procs[node].terminate()
            try:
                self.procs[node].wait(30)
            except subprocess.TimeoutExpired:
                self.procs[node].kill()
        codes = {}
        for node, proc in self.procs.items():
            try:
                codes[node] = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[node] = None
        return codes


@pytest.fixture(scope="module")
def toml_cluster(
    chat_llama: Path, tmp_path_factory: pytest.TempPathFactory, model_cache: Path
) -> Iterator[TomlCluster]:
    """Five ``mlxppd serve --distributed-config`` processes: four stage nodes from a 2x2 TOML
    (s1-r1 with a small KV budget) and the coordinator."""
    import os

    tmp = tmp_path_factory.mktemp("tp-2x2")
    env = {**os.environ, "MLXPP_CACHE_DIR": str(model_cache), "OPENBLAS_NUM_THREADS": "1"}
    nodes = ("coordinator", "s0-r0", "s0-r1", "s1-r0", "s1-r1")
    config = tmp / "cluster.toml"
    config.write_text(cluster_toml({n: free_port() for n in nodes}))
    secret = tmp / "cluster.secret"
    write_new_secret(secret)
    keys = write_node_keys(tmp / "keys", nodes)
    trace = tmp / "trace.json"
    http_port = free_port()
    procs, logs = {}, {}
    for node in nodes:
        cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve",
               "--distributed-config", str(config), "--node-id", node, "--model", str(chat_llama),
               "--cluster-secret-file", str(secret),
               "--node-key-file", str(keys[node])]  # fmt: skip
        if node == "s1-r1":
            cmd += ["--kv-budget-bytes", str(SMALL_BUDGET)]
        if node == "coordinator":
            cmd += ["--port", str(http_port), "--metrics", "--debug-pp-trace", str(trace)]
            cmd += ["--ready-file", str(tmp / "coordinator.ready")]
        logs[node] = tmp / f"{node}.log"
        with logs[node].open("wb") as out:
            procs[node] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    cluster = TomlCluster(f"http://127.0.0.1:{http_port}", secret, trace, procs, logs)
    deadline = time.monotonic() + 240
    while not (tmp / "coordinator.ready").exists():
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            cluster.stop()
            raise RuntimeError(f"{dead or 'nothing'} exited:\n" + cluster.log((dead or nodes)[0]))
        time.sleep(0.1)
    yield cluster
    cluster.stop()


def status(cluster: TomlCluster, *, as_json: bool = True) -> Any:
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppctl_main", "status", "--url", cluster.url,
           "--cluster-secret-file", str(cluster.secret)]  # fmt: skip
    done = subprocess.run(cmd + (["--json"] if as_json else []), capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout) if as_json else done.stdout


def test_a_2x2_cluster_from_a_toml_answers_as_single_process_mlx_lm(
    toml_cluster: TomlCluster, reference: dict[tuple[str, int], str]
) -> None:
    answer = chat(toml_cluster.url, QUESTION, ANSWER_TOKENS)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == reference[(QUESTION, ANSWER_TOKENS)]
    # Rank 1 of each stage ran the same passes on its own shard.
    for stage in (0, 1):
        log = toml_cluster.log(f"s{stage}-r1")
        assert f"stage {stage}: tensor-parallel rank 1 of 2 joined its ring" in log, log
        assert "following rank 0" in log, log


def test_status_shows_one_card_per_slot_with_its_shard_and_kv(
    toml_cluster: TomlCluster, chat_llama: Path
) -> None:
    from mlxppd.core.profile.model import read_model_config
    from mlxppd.core.stages import StageSpec
    from mlxppd.engine.stage import load_stage

    document = status(toml_cluster)
    stages = document["stages"]
    assert [s["node_id"] for s in stages] == ["s0-r0", "s1-r0"]
    config = read_model_config(chat_llama)
    for index, stage in enumerate(stages):
        slots = stage["slots"]
        assert [(s["rank"], s["node_id"]) for s in slots] == [
            (0, f"s{index}-r0"), (1, f"s{index}-r1"),
        ]  # fmt: skip
        # Each rank holds half of the stage's layer weights plus what is not sharded (the
        # embedding or the output head, the norms), measured against an unsharded load.
        whole = load_stage(chat_llama, StageSpec(index, 2, 2 * index, 2 * index + 2), config)
        layers = sum(v.nbytes for _, v in _flat(whole.net.model, "layers"))
        expected = whole.parameter_bytes - layers + layers / 2
        for slot in slots:
            assert abs(slot["parameter_bytes"] - expected) < 0.02 * whole.parameter_bytes, (
                slot,
                expected,
            )
    assert stages[1]["slots"][1]["kv_budget_bytes"] == SMALL_BUDGET
    text = status(toml_cluster, as_json=False)
    assert "stage 1  rank 1  s1-r1" in text, text
    assert "stage 0  rank 0  s0-r0" in text, text


def _flat(model: Any, part: str) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    return [(k, v) for k, v in tree_flatten(model.parameters()) if f".{part}." in f".{k}"]


def test_a_budget_too_small_on_one_slot_refuses_naming_it_and_caches_nothing(
    toml_cluster: TomlCluster,
) -> None:
    refused = chat(toml_cluster.url, QUESTION, 400)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "stage 1 rank 1" in error["message"], error
    assert (error["stage"], error["rank"]) == (1, 1), error
    for stage in status(toml_cluster)["stages"]:
        assert stage["in_flight"] == 0
        assert [s["kv_used_bytes"] for s in stage["slots"]] == [0, 0], stage
    # The slot that refused still serves a request that fits.
    assert chat(toml_cluster.url, QUESTION, 8).status_code == 200


def test_metrics_carry_each_slot_and_the_trace_has_a_track_per_slot(
    toml_cluster: TomlCluster,
) -> None:
    assert chat(toml_cluster.url, QUESTION, 8).status_code == 200
    metrics = httpx.get(f"{toml_cluster.url}/metrics", timeout=30).text
    for stage in (0, 1):
        for rank in (0, 1):
            assert f'mlxpp_slot_parameter_bytes{{rank="{rank}",stage="{stage}"}}' in metrics
    assert f'mlxpp_slot_kv_budget_bytes{{rank="1",stage="1"}} {float(SMALL_BUDGET)}' in metrics
    codes = toml_cluster.stop()
    assert set(codes.values()) == {0}, codes
    for node in ("s0-r1", "s1-r1"):
        assert "rank 0 stopped after" in toml_cluster.log(node)
    events = json.loads(toml_cluster.trace.read_text())["traceEvents"]
    tracks = {e["pid"] for e in events if e.get("name") == "stage" and e.get("ph") == "X"}
    assert {"stage-0", "stage-1", "stage-0 rank 1", "stage-1 rank 1"} <= tracks, tracks


def _child_with(parent: int, text: str) -> int:
    """The pid of ``parent``'s child whose command line holds ``text``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and text in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"no child of {parent} runs {text!r}")


def test_a_local_2x2_cluster_answers_and_restarts_a_stage_whose_rank_died(
    chat_llama: Path,
    cli_env: dict[str, str],
    tmp_path: Path,
    reference: dict[tuple[str, int], str],
) -> None:
    from tests.support.clusters import kill, start_cluster, wait_gone

    expected = reference[(QUESTION, ANSWER_TOKENS)]
    running = start_cluster(
        tmp_path, cli_env, "--pp-size", "2", "--tp-size", "2", "--model", str(chat_llama)
    )
    try:
        first = chat(running.url, QUESTION, ANSWER_TOKENS)
        assert first.json()["choices"][0]["message"]["content"] == expected
        # A rank that dies takes its stage's other rank down; both start again together.
        follower = _child_with(running.proc.pid, "--node-id stage-1-rank-1")
        kill(follower)
        assert wait_gone([follower]) == []
        deadline = time.monotonic() + 180
        while "failover: reconnected" not in running.log():
            assert time.monotonic() < deadline, running.log()[-3000:]
            time.sleep(0.2)
        again = chat(running.url, QUESTION, ANSWER_TOKENS)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"]["content"] == expected
        assert _child_with(running.proc.pid, "--node-id stage-1-rank-1") != follower
    finally:
        assert running.stop() == 0, running.log()[-3000:]
