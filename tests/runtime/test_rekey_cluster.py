"""Rekeying on a real cluster: a long stream keeps every token while every stage link replaces
its keys many times over.

Three real ``mlxppd serve --distributed-config`` processes (a coordinator and two stages, each
with its own node key) serve a cluster TOML whose ``[cluster]`` shrinks the rekey bounds to a
few records and a quarter of a second. A 160-token greedy stream then crosses each link a few
hundred times: at the default bounds (2^24 records, 120 s) that many rekeys take a stream of
hours, so this stands in for the 10-minute stream. Its text must equal the same request's on a
cluster that never rekeys while it runs, and the coordinator's metrics count the rekeys.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxppd.core.config.ports import parse_port_range
from mlxppd.runtime.local_cluster import free_ports_in
from mlxppd.wire.secret import write_new_secret
from tests.support.clusters import RunningCluster, start_cluster
from tests.support.node_keys import roster_toml, write_node_keys

NODES = ("coordinator", "stage-0", "stage-1")
PROMPT = "Count slowly from one to one hundred, one number per line."
TOKENS = 160


def _env() -> dict[str, str]:
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _cluster_toml(ports: tuple[int, ...]) -> str:
    lines = [
        "[cluster]",
        'name = "rekey-test"',
        "pipeline_parallel_size = 2",
        "rekey_after_records = 16",
        "rekey_after_s = 0.25",
        "",
        "[[nodes]]",
        'id = "coordinator"',
        f'address = "127.0.0.1:{ports[0]}"',
        'role = "hybrid"',
    ]
    for stage in (0, 1):
        lines += [
            "",
            "[[nodes]]",
            f'id = "stage-{stage}"',
            f'address = "127.0.0.1:{ports[stage + 1]}"',
        ]
        lines += ['role = "pipeline_stage"', f"stage = {stage}"]
    return "\n".join(lines) + "\n" + roster_toml(NODES)


def _wait_ready(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{path.name} never became ready:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)
    return path.read_text().strip()


@pytest.fixture
def rekeying_cluster(tmp_path: Path, embedded_model_dir: object) -> Iterator[str]:
    """The coordinator's URL of a 2-stage cluster that rekeys every 16 records or 0.25 s."""
    port_range = parse_port_range(os.environ.get("MLXPP_TRANSPORT_PORT_RANGE", "39600-39629"))
    toml = tmp_path / "cluster.toml"
    toml.write_text(_cluster_toml(free_ports_in(port_range, 3)))
    secret = tmp_path / "cluster.secret"
    write_new_secret(secret)
    keys = write_node_keys(tmp_path / "keys", NODES)
    procs: list[subprocess.Popen[bytes]] = []
    base = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--distributed-config"]
    try:
        for node in NODES:
            ready, log = tmp_path / f"{node}.ready", tmp_path / f"{node}.log"
            cmd = [*base, str(toml), "--node-id", node, "--node-key-file", str(keys[node])]
            cmd += ["--cluster-secret-file", str(secret), "--ready-file", str(ready)]
            if node == "coordinator":
                cmd += ["--port", "0", "--metrics", "--no-warmup"]
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env())
                )
        ready = [
            _wait_ready(tmp_path / f"{node}.ready", proc, tmp_path / f"{node}.log", 240.0)
            for node, proc in zip(NODES, procs, strict=True)
        ]
        yield ready[0]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _stream(url: str) -> tuple[str, str | None, int]:
    """(text, finish reason, chunks) of a greedy streamed chat completion."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    text, finish, chunks = "", None, 0
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
            chunks += 1
    return text, finish, chunks


def _metric(url: str, name: str) -> float:
    """The sum of ``name``'s samples (every label set) on the coordinator's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        page = response.read().decode()
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", page, re.M)
    )


@pytest.fixture
def reference_text(tmp_path: Path, embedded_model_dir: object) -> str:
    """The same stream on a local cluster at the default bounds (no rekey during it)."""
    where = tmp_path / "reference"
    where.mkdir()
    cluster: RunningCluster = start_cluster(where, _env(), "--pp-size", "2")
    try:
        text, finish, _ = _stream(cluster.url)
    finally:
        cluster.stop()
    assert finish == "length"
    return text


def test_a_long_stream_keeps_every_token_while_the_links_rekey(
    reference_text: str, rekeying_cluster: str
) -> None:
    assert (
        "mlxpp_transport_rekeys_total"
        in urllib.request.urlopen(f"{rekeying_cluster}/metrics", timeout=30).read().decode()
    )
    before = _metric(rekeying_cluster, "mlxpp_transport_rekeys_total")
    text, finish, chunks = _stream(rekeying_cluster)
    assert finish == "length"
    assert chunks >= TOKENS // 2
    assert text == reference_text
    # Every link's two directions rekeyed many times while it streamed (16 records per key).
    rekeys = _metric(rekeying_cluster, "mlxpp_transport_rekeys_total") - before
    assert rekeys >= 2 * TOKENS // 16, rekeys
    assert _metric(rekeying_cluster, "mlxpp_transport_rejected_frames_total") == 0
