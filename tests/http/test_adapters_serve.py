"""LoRA adapters on the embedded model, made by mlx-lm's own trainer, through the pipeline.

Every answer is compared with single-process mlx-lm running the same adapter unfused
(``load_adapters``, what ``mlx_lm.generate --adapter-path`` does), greedy, token for token.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxppd.core.adapters import MLX_FILE, tensor_name
from mlxppd.core.stage_tensors import layer_of
from mlxppd.engine.stage_digest import safetensors_header
from mlxppd.wire.secret import write_new_secret
from tests.support.adapters import PIRATE, random_adapter, train_adapter
from tests.support.clusters import RunningCluster, start_cluster, wait_gone
from tests.support.references import answers_of, copy_of, load_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTION = "Who wrote Hamlet?"
TOKENS = 8  # every adapter already changes the answer in its first words
MLXPPCTL = [sys.executable, "-m", "mlxppd.cli.mlxppctl_main"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> dict[str, Path]:
    """pirate: trained by mlx-lm's trainer (LoRA over every layer); robot: LoRA over every
    layer and third: DoRA over the last 8, both in mlx-lm's layout with random weights (a
    trained one costs ~10 s of CPU, and serving does not depend on what it learned). Three
    iterations already put the pirate's "Arr, matey!" in the answer."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "pirate": train_adapter(embedded_model_dir, root / "pirate", PIRATE, iters=3),
        "robot": random_adapter(embedded_model_dir, root / "robot", num_layers=30, seed=1),
        "third": random_adapter(
            embedded_model_dir, root / "third", num_layers=8, seed=2, kind="dora"
        ),
    }


@pytest.fixture(scope="module")
def reference(embedded_model_dir: Path, adapters: dict[str, Path]) -> dict[str | None, str]:
    """mlx-lm's greedy answer with each adapter (None: the base model), the adapter unfused
    (``load_adapters``, as ``tests.support.adapters.adapted_reference``) on a copy of the one
    converted base model."""
    from mlx_lm.tuner.utils import load_adapters

    base, tokenizer = load_reference(embedded_model_dir)
    ask = [(QUESTION, TOKENS)]
    out: dict[str | None, str] = {None: answers_of(base, tokenizer, ask)[ask[0]]}
    for name, path in adapters.items():
        model = copy_of(embedded_model_dir, base)
        load_adapters(model, str(path))
        model.eval()
        out[name] = answers_of(model, tokenizer, ask)[ask[0]]
    # Not vacuous: every adapter changes the answer, each its own way.
    assert len(set(out.values())) == len(out), out
    return out


def _env(model_cache: Path) -> dict[str, str]:
    return {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}


def _per_layer_tensors(adapter: Path) -> dict[int, int]:
    _, header = safetensors_header(adapter / MLX_FILE)
    counts: dict[int, int] = {}
    for name in header:
        where = tensor_name(name, "mlx")
        assert where is not None
        layer = layer_of(where.module + ".x")
        assert layer is not None
        counts[layer] = counts.get(layer, 0) + 1
    return counts


def test_generate_with_an_adapter_equals_mlx_lm_and_each_stage_reads_only_its_layers(
    adapters: dict[str, Path], reference: dict[str | None, str], model_cache: Path
) -> None:
    # Three stages: the middle one's range is bounded on both sides (the served clusters
    # below run two).
    stages = 3
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "generate", "--pp-size", str(stages)]
    cmd += ["--adapter", str(adapters["pirate"]), "-n", str(TOKENS), "--json", "-p", QUESTION]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(model_cache), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"] == reference["pirate"]
    ranges = re.findall(r"stage \d+/\d+: layers (\d+)-(\d+)", proc.stderr)
    reads = re.findall(r"fused into \d+ modules, (\d+) of its (\d+) tensors read", proc.stderr)
    assert len(ranges) == len(reads) == stages, proc.stderr
    per_layer = _per_layer_tensors(adapters["pirate"])
    for (first, last), (read, stored) in zip(ranges, reads, strict=True):
        own = sum(n for layer, n in per_layer.items() if int(first) <= layer <= int(last))
        assert int(read) == own and int(stored) == sum(per_layer.values())
    assert sum(int(read) for read, _ in reads) == sum(per_layer.values())


def test_a_served_cluster_with_a_fused_adapter_answers_like_mlx_lm(
    tmp_path: Path, adapters: dict[str, Path], reference: dict[str | None, str], model_cache: Path
) -> None:
    flags = ("--pp-size", "2", "--adapter", str(adapters["pirate"]), "--prompt-cache-entries", "0")
    running = start_cluster(tmp_path, _env(model_cache), *flags)
    try:
        assert _chat(running.url, None) == reference["pirate"]
        assert re.search(r"stage 1: adapter fused \(.*\) on \d+ modules", running.log())
    finally:
        assert running.stop() == 0, running.log()


@pytest.fixture(scope="module")
def named(
    tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path], model_cache: Path
) -> Iterator[tuple[RunningCluster, Path]]:
    """A 2-stage cluster serving the base model plus two adapters chosen per request."""
    root = tmp_path_factory.mktemp("named")
    secret = root / "cluster.secret"
    write_new_secret(secret)
    flags = ["--pp-size", "2", "--cluster-secret-file", str(secret)]
    flags += [
        "--adapter",
        f"pirate={adapters['pirate']}",
        "--adapter",
        f"robot={adapters['robot']}",
    ]
    running = start_cluster(root, _env(model_cache), *flags)
    yield running, secret
    assert running.stop() == 0, running.log()
    assert wait_gone(running.stage_pids) == []


def _chat(url: str, model: str | None) -> str:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": TOKENS,
        "temperature": 0,
    }
    if model is not None:
        body["model"] = model
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    document = reply.json()
    assert document["model"] == model or model is None
    return str(document["choices"][0]["message"]["content"])


def _ctl(running: RunningCluster, secret: Path, *args: str) -> subprocess.CompletedProcess[str]:
    target = ("--url", running.url, "--cluster-secret-file", str(secret))
    return subprocess.run(
        [*MLXPPCTL, "adapter", *args, *target], capture_output=True, text=True, timeout=300
    )


def test_two_adapters_and_the_base_model_answer_at_once_each_like_mlx_lm(
    named: tuple[RunningCluster, Path], reference: dict[str | None, str], embedded_model_dir: Path
) -> None:
    running, _ = named
    models = [m["id"] for m in httpx.get(running.url + "/v1/models").json()["data"]]
    assert models == [embedded_model_dir.name, "pirate", "robot"]
    asks = [None, "pirate", "robot"]  # three at once: they share micro-batches
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda m: _chat(running.url, m), asks))
    assert answers == [reference[m] for m in asks]
    # Each stage read only its own layers' tensors of each adapter.
    reads = re.findall(
        r"stage (\d): adapter (\w+) .* (\d+) of its (\d+) tensors read", running.log()
    )
    for name in ("pirate", "robot"):
        mine = [(int(read), int(stored)) for _, n, read, stored in reads if n == name]
        assert len(mine) == 2 and sum(r for r, _ in mine) == mine[0][1], reads


def test_an_adapter_loaded_live_serves_at_once_and_an_unloaded_one_is_gone(
    named: tuple[RunningCluster, Path],
    adapters: dict[str, Path],
    reference: dict[str | None, str],
) -> None:
    running, secret = named
    loaded = _ctl(running, secret, "load", "third", str(adapters["third"]))
    assert loaded.returncode == 0, loaded.stderr + running.log()[-3000:]
    # The DoRA adapter covers the last 8 of 30 layers: stage 0 (layers 0-14) reads none of it.
    assert re.search(
        r"loaded on 2 stages \(tensors read per stage: 0/(\d+), \1/\1\)", loaded.stdout
    )

    assert _ctl(running, secret, "unload", "robot").returncode == 0
    models = [m["id"] for m in httpx.get(running.url + "/v1/models").json()["data"]]
    assert models[1:] == ["pirate", "third"]
    gone = httpx.post(
        running.url + "/v1/chat/completions",
        json={"model": "robot", "messages": [{"role": "user", "content": QUESTION}]},
    )
    assert gone.status_code == 404 and "robot" in gone.json()["error"]["message"]
    refused = _ctl(running, secret, "load", "bad", str(adapters["third"].parent))
    assert refused.returncode == 1 and "has no adapter_config.json" in refused.stderr
    again = _ctl(running, secret, "load", "pirate", str(adapters["third"]))
    assert again.returncode == 1 and "'pirate' is loaded already; unload it first" in again.stderr
    listed = _ctl(running, secret, "list")
    assert "pirate:" in listed.stdout and "third:" in listed.stdout and "robot" not in listed.stdout
    # The loaded adapter serves, and the others serve on untouched (pirate, whose name the
    # refused load asked for, and the base model), all at once.
    asks = ["third", "pirate", None]
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda m: _chat(running.url, m), asks))
    assert answers == [reference[m] for m in asks]
