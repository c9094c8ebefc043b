"""A real local cluster: stage processes on loopback, the coordinator's OpenAI API over HTTP.

Three clusters in all (each start costs a few CPU-seconds per process): one shared two-stage
cluster (fixed micro-batches of 4 and a KV budget) for the HTTP, parity, admission and
micro-batch tests, a three-stage one whose stage is killed mid-stream, and one that fails to
start."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.clusters import (
    RunningCluster,
    kill,
    listens_on,
    restarted_stage_pids,
    stage_port_and_pid,
    start_cluster,
    wait_gone,
)
from tests.support.references import load_reference

#: tokens per answer (the references are mlx-lm's answers of this length)
MAX_TOKENS = 12
#: a short system prompt (the chat template's default one is 30 tokens of prefill a request)
SYSTEM = "Be brief."
#: the shared cluster's KV budget per stage: about 760 tokens on the embedded model's larger
#: stage (17 layers) and 1000 on the other; 6 concurrent short chats fit, so does one request
#: of LONG_REQUEST tokens, two of them do not (KV admission reserves prompt + max_tokens)
KV_BUDGET = 20_000_000
LONG_REQUEST = 500

QUESTIONS = [
    "What is the capital of France?",
    "Tell me a story about a dragon.",
    "Explain how a steam engine works.",
    "List three colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
]


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def reference(embedded_model_dir: Path) -> dict[str, str]:
    """Single-process mlx-lm's greedy answer to each question (MAX_TOKENS of them), with the
    weights held as a served stage holds them."""
    from mlx_lm import generate

    model, tokenizer = load_reference(embedded_model_dir)
    return {
        q: str(
            generate(
                model,
                tokenizer,
                tokenizer.apply_chat_template(messages(q), add_generation_prompt=True),
                max_tokens=MAX_TOKENS,
            )
        )
        for q in QUESTIONS
    }


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path, model_cache: Path
) -> Iterator[RunningCluster]:
    """Two stages, decode steps in micro-batches of 4, and a KV budget on each stage."""
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    flags = ["--pp-size", "2", "--pp-micro-batch-size", "4", "--kv-budget-bytes", str(KV_BUDGET)]
    running = start_cluster(tmp_path_factory.mktemp("pp2"), env, *flags)
    yield running
    assert running.stop() == 0, running.log()
    assert wait_gone(running.stage_pids) == [], "stage processes left behind"


def chat(url: str, question: str, **extra: object) -> httpx.Response:
    body = {
        "messages": messages(question),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_health_and_models(cluster: RunningCluster) -> None:
    health = httpx.get(f"{cluster.url}/health", timeout=10)
    assert health.status_code == 200
    # No ports were given: the stages took theirs from the transport range, in order
    # (docs/operations.md, "Ports and firewalls").
    ports = [stage_port_and_pid(cluster, stage)[0] for stage in (0, 1)]
    # (this test worker's range when the suite runs on several: tests/conftest.py)
    first, last = map(int, os.environ.get("MLXPP_TRANSPORT_PORT_RANGE", "39600-39629").split("-"))
    assert all(first <= port <= last for port in ports) and ports[0] < ports[1], ports
    models = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()
    assert models["data"][0]["id"]


def test_openai_client_streaming_and_not(
    cluster: RunningCluster, reference: dict[str, str]
) -> None:
    """One request alone on two stages, asked through the openai client: its answer, whole and
    streamed, is single-process mlx-lm's."""
    import openai

    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    q = QUESTIONS[3]
    whole = client.chat.completions.create(
        model=model,
        messages=messages(q),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    assert whole.choices[0].message.content == reference[q]
    stream = client.chat.completions.create(
        model=model,
        messages=messages(q),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reference[q]


def test_a_kv_budget_rejects_a_long_prompt_with_a_diagnostic(cluster: RunningCluster) -> None:
    # About 1240 prompt tokens: more than either stage's whole budget; a short chat fits.
    long = chat(cluster.url, "Summarise this: " + "the quick brown fox " * 300)
    # More than a stage's whole budget: a 400 without Retry-After (retrying cannot help).
    assert long.status_code == 400, long.text
    assert "Retry-After" not in long.headers
    error = long.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["reason"] == "memory"
    assert error["stage"] in (0, 1)
    assert error["required_bytes"] > error["budget_bytes"] == KV_BUDGET
    short = chat(cluster.url, "Hi", max_tokens=4)
    assert short.status_code == 200, short.text


def test_a_client_that_disconnects_frees_its_kv_on_every_stage(cluster: RunningCluster) -> None:
    # Room for one request of this size on each stage, not two (KV_BUDGET).
    body = {
        "messages": messages("Tell me a very long story."),
        "max_tokens": LONG_REQUEST,
        "temperature": 0,
        "stream": True,
    }
    url = f"{cluster.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        events = response.iter_lines()
        next(line for line in events if line)
        # While the first request holds its KV, a second one does not fit anywhere.
        second = httpx.post(url, json={**body, "stream": False}, timeout=60)
        assert second.status_code == 503, second.text
    # The client is gone: its reservation is released on every stage, so it fits again.
    # (Generous: only a reservation that is never released runs into the deadline.)
    deadline = time.monotonic() + 120
    while True:
        # Same reservation (prompt + LONG_REQUEST tokens); the stop string ends it early.
        again = httpx.post(url, json={**body, "stream": False, "stop": ["."]}, timeout=120)
        if again.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert again.status_code == 200, again.text
    # Freed because the client left, not because its generation ran to the end anyway.
    cut = re.search(r"completion_tokens=(\d+) \(client closed the stream\)", cluster.log())
    assert cut is not None and int(cut.group(1)) < LONG_REQUEST, cluster.log()[-3000:]


def test_six_concurrent_requests_run_as_micro_batches_and_each_match_their_own_result(
    cluster: RunningCluster, reference: dict[str, str]
) -> None:
    """Last on the shared cluster: it stops it, for the stages' pass counts."""
    answers: dict[str, str] = {}

    def ask(q: str) -> None:
        answers[q] = chat(cluster.url, q).json()["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert answers == reference
    assert cluster.stop() == 0, cluster.log()
    # Each stage ran decode steps as batched passes of several sequences at once (the
    # stages log their counts as they stop). The lone requests above were passes of one row
    # each: the rows beyond one a pass are the concurrent requests', at least a quarter of
    # their decode steps (48 of 72 when the groups of 4 and 2 run full).
    stats = re.findall(
        r"stage (\d): \d+ forward passes, (\d+) of them micro-batches of ([\d.]+)", cluster.log()
    )
    assert len(stats) == 2, cluster.log()[-2000:]
    for _stage, passes, mean_rows in stats:
        extra_rows = round(float(mean_rows) * int(passes)) - int(passes)
        assert extra_rows >= len(QUESTIONS) * MAX_TOKENS // 4, stats


STREAMS = {"story": QUESTIONS[1], "engine": QUESTIONS[2]}


def stream_text(
    url: str, chat_messages: list[dict[str, str]], max_tokens: int, seen: threading.Event
) -> str:
    """A streamed chat's text; sets ``seen`` after 4 chunks; any error event fails."""
    body = {"messages": chat_messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, chunks = "", 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"]:
                text += event["choices"][0]["delta"].get("content") or ""
            chunks += 1
            if chunks == 4:
                seen.set()
    return text


def test_three_stages_answer_like_mlx_lm_even_with_a_stage_killed_mid_stream(
    tmp_path: Path, cli_env: dict[str, str], reference: dict[str, str]
) -> None:
    """serve --pp-size 3: SIGKILL stage 1 while two streams run; its supervisor restarts it on
    its port, the coordinator reconnects and replays both, and the clients see, with no
    error, single-process mlx-lm's greedy answers (what uninterrupted streams show)."""
    running = start_cluster(tmp_path, cli_env, "--pp-size", "3", "--verbose")
    try:
        port, old_pid = stage_port_and_pid(running, 1)
        texts: dict[str, str] = {}
        seen = {name: threading.Event() for name in STREAMS}

        def run(name: str) -> None:
            texts[name] = stream_text(running.url, messages(STREAMS[name]), MAX_TOKENS, seen[name])

        threads = [threading.Thread(target=run, args=(name,)) for name in STREAMS]
        for t in threads:
            t.start()
        for event in seen.values():
            assert event.wait(300)
        kill(running.stage_pids[1])
        for t in threads:
            t.join(600)
        assert texts == {name: reference[q] for name, q in STREAMS.items()}
        log = running.log()
        # Its supervisor restarted it on the same port (the coordinator reconnected there).
        (new_pid,) = restarted_stage_pids(running, 1)
        assert new_pid != old_pid and listens_on(new_pid, port)
        assert f"stage 1 (pid {old_pid}) exited with status -9; restarting it on" in log
        assert restarted_stage_pids(running, 0) == restarted_stage_pids(running, 2) == []
        assert re.search(
            r"failover: reconnected after [\d.]+ s: the lost node came back; 2 "
            r"sequences replayed",
            log,
        ), log[-3000:]
        health = httpx.get(f"{running.url}/health", timeout=30)
        assert health.status_code == 200
        # Pre-launch warnings and --verbose (docs/partitioning.md): 3 stages over TCP warn,
        # the llama family does not, and the report shows what each stage loaded.
        warning = r"WARNING partition warning: 3 stages over TCP: .*each extra TCP hop"
        assert re.search(warning, log)
        assert "outside the best-tested set" not in log
        assert "pipeline partition quality: 3 stages, max=" in log
        for stage in range(3):
            row = rf"  stage {stage} device '\S+' layers=\d+ estimated=\d+ actual=\d+"
            assert re.search(row, log)
    finally:
        assert running.stop() == 0, running.log()
    restarted = restarted_stage_pids(running, 1)
    assert wait_gone([running.proc.pid, *running.stage_pids, *restarted]) == []
    # Stopping is not mistaken for a crash: nothing was restarted on the way down.
    assert len(restarted_stage_pids(running, 1)) == 1


def test_a_stage_that_fails_to_start_stops_everything_already_started(
    tmp_path: Path, embedded_model_dir: Path, cli_env: dict[str, str]
) -> None:
    import shutil
    import subprocess
    import sys

    import mlx.core as mx

    # A checkpoint missing layer 20: stage 0 (layers 0-14) loads, stage 1 cannot.
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for f in embedded_model_dir.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, broken / f.name)
    tensors = mx.load(str(embedded_model_dir / "model.safetensors"))
    assert isinstance(tensors, dict)
    kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.20.")}
    mx.save_safetensors(str(broken / "model.safetensors"), kept)

    proc = subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--model", str(broken),
         "--pp-layers", "0-14,15-29", "--port", "0"],
        capture_output=True, text=True, env=cli_env, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "model.layers.20" in proc.stderr  # the failing stage says what is missing
    assert "stage 1 exited with status" in proc.stderr
    pids = [int(p) for p in re.findall(r"starting stage \d+/\d+ \(pid (\d+)\)", proc.stderr)]
    assert len(pids) == 2
    assert wait_gone(pids) == [], "a started stage was left running"
