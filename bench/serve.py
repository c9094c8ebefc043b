"""Serving speed of a local mlxpp cluster against mlx-lm, measured in one run.

    .venv/bin/python bench/serve.py [--model DIR] [--pp-size 2] [--max-tokens 48] [--streams 8]

The cluster is ``mlxppd serve --pp-size N`` with default flags (add ``--micro-batch-size``,
``--cpu-weights`` to change them); ``mlx_lm.server`` runs as a user runs it today: the
checkpoint as stored, on the BLAS its wheel bundles. Prints a markdown table:
- time to first token of a 417-token chat prompt (streaming over HTTP), both servers;
- single stream: decode tokens/s of the cluster against ``mlx_lm.server`` and against
  single-process mlx-lm (``generate_step`` in this process, no HTTP, the wheel's BLAS);
- N concurrent streams: aggregate generated tokens/s of both servers on the same N requests;
- without ``--cpu-weights``: a second table, prefill and decode tokens/s of the same cluster on
  the checkpoint's own weights (``--cpu-weights native``) and on float32 (the Linux CPU
  default), beside ``mlx_lm.server``.
Goals: time to first token >= 10x faster than mlx_lm.server; single-stream decode >= 0.9x
mlx-lm; aggregate >= 1.0x mlx_lm.server.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prompts import CHAT_PROMPT

QUESTIONS = [
    "Tell me a long story about a dragon who learns to play the violin.",
    "Explain in detail how a steam engine works.",
    "Describe the water cycle step by step.",
    "Write a long poem about the sea.",
    "Explain how computers store numbers.",
    "Describe a day in the life of a medieval farmer.",
    "Explain photosynthesis to a child.",
    "Tell me about the history of the bicycle.",
]


@dataclass
class StreamResult:
    ttft_s: float
    decode_tps: float
    tokens: int
    wall_s: float
    prompt_tokens: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stream_chat(
    base: str, model: str, question: str, max_tokens: int, **extra: Any
) -> StreamResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    start = time.perf_counter()
    first = last = 0.0
    chunks = 0
    tokens = 0
    prompt_tokens = 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
                prompt_tokens = int(event["usage"].get("prompt_tokens", 0))
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    wall = time.perf_counter() - start
    tokens = tokens or chunks
    decode = (tokens - 1) / (last - first) if last > first and tokens > 1 else 0.0
    return StreamResult(first - start, decode, tokens, wall, prompt_tokens)


def concurrent(base: str, model: str, n: int, max_tokens: int) -> float:
    """Aggregate generated tokens per second of n simultaneous streams."""
    results: list[StreamResult] = []
    threads = [
        threading.Thread(target=lambda q=q: results.append(stream_chat(base, model, q, max_tokens)))
        for q in (QUESTIONS * (n // len(QUESTIONS) + 1))[:n]
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(r.tokens for r in results) / (time.perf_counter() - start)


def wait_http(base: str, path: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{base} did not come up")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def mlx_lm_single(model_dir: Path, max_tokens: int) -> StreamResult:
    """Single-process mlx-lm in this process: the checkpoint as stored, mlx's default BLAS."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(model_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True
    )
    best: StreamResult | None = None
    for _ in range(2):  # the first run warms kernels up, as the servers' warm-up does
        start = time.perf_counter()
        first = 0.0
        n = 0
        for _token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
            n += 1
            first = first or time.perf_counter()
        end = time.perf_counter()
        best = StreamResult(first - start, (n - 1) / (end - first), n, end - start)
    assert best is not None
    return best


@dataclass
class ServerRun:
    ttft_long: StreamResult
    single: StreamResult
    aggregate: float
    #: the same kind of answer, free and constrained by a JSON schema (the cluster only)
    free_json: StreamResult | None = None
    schema_json: StreamResult | None = None


#: a JSON answer of a few dozen tokens, asked for freely and then held to a schema
JSON_QUESTION = "Describe a fictional person as a JSON object with name, age, city and hobbies."
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
}


def measure(base: str, model: str, args: argparse.Namespace) -> ServerRun:
    """Warm up on a short question, then the long prompt (first sight: no prompt cache can
    help), one stream, and N concurrent streams."""
    stream_chat(base, model, QUESTIONS[1], 8)
    ttft_long = stream_chat(base, model, CHAT_PROMPT, 8)
    single = stream_chat(base, model, QUESTIONS[0], args.max_tokens)
    aggregate = concurrent(base, model, args.streams, args.max_tokens)
    return ServerRun(ttft_long, single, aggregate)


def measure_json(base: str, model: str, run: ServerRun, max_tokens: int) -> ServerRun:
    """Decode speed with and without a json_schema constraint (the grammar's overhead)."""
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": JSON_SCHEMA}}
    free = stream_chat(base, model, JSON_QUESTION, max_tokens, temperature=1.0, seed=3)
    held = stream_chat(
        base, model, JSON_QUESTION, max_tokens, temperature=1.0, seed=3, response_format=schema
    )
    return ServerRun(run.ttft_long, run.single, run.aggregate, free, held)


def run_cluster(model_dir: Path, args: argparse.Namespace, env: dict[str, str]) -> ServerRun:
    ready = Path(tempfile.mkdtemp()) / "ready"
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--model", str(model_dir),
           "--pp-size", str(args.pp_size), "--port", "0", "--ready-file", str(ready),
           "--log-level", "WARNING"]  # fmt: skip
    if args.micro_batch_size is not None:
        cmd += ["--pp-micro-batch-size", str(args.micro_batch_size)]
    if args.cpu_weights is not None:
        cmd += ["--cpu-weights", args.cpu_weights]
    cluster = subprocess.Popen(cmd, env=env)
    try:
        while not ready.exists():
            if cluster.poll() is not None:
                raise RuntimeError("the cluster did not start")
            time.sleep(0.1)
        base = ready.read_text().strip()
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        return measure_json(base, model, measure(base, model, args), args.max_tokens)
    finally:
        stop(cluster)


def run_mlx_lm_server(model_dir: Path, args: argparse.Namespace, env: dict[str, str]) -> ServerRun:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        sbase = f"http://127.0.0.1:{port}"
        wait_http(sbase, "/v1/models", server)
        return measure(sbase, str(model_dir), args)
    finally:
        stop(server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--pp-size", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument(
        "--micro-batch-size", help="--pp-micro-batch-size of the cluster (default: its default)"
    )
    parser.add_argument("--cpu-weights", help="--cpu-weights of the cluster (default: auto)")
    args = parser.parse_args(argv)

    from mlxppd.engine.model_files import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    # Neither server inherits a BLAS choice from this shell: each runs as it would by itself.
    env = {k: v for k, v in os.environ.items() if k != "MLXPP_BLAS"}
    env["HF_HUB_OFFLINE"] = "1"

    base_single = mlx_lm_single(model_dir, args.max_tokens)
    print("mlx-lm single stream measured", file=sys.stderr)
    ours = run_cluster(model_dir, args, env)
    print("cluster measured", file=sys.stderr)
    # The same cluster on the checkpoint's own weights: what float32 buys on this host.
    native = None
    if args.cpu_weights is None:
        native = run_cluster(
            model_dir, argparse.Namespace(**{**vars(args), "cpu_weights": "native"}), env
        )
        print("cluster on native weights measured", file=sys.stderr)
    theirs = run_mlx_lm_server(model_dir, args, env)
    print("mlx_lm.server measured", file=sys.stderr)

    def ms(r: StreamResult) -> str:
        return f"{r.ttft_s * 1000:.0f} ms"

    rows = [
        (
            "time to first token, 417-token chat prompt",
            ms(theirs.ttft_long),
            ms(ours.ttft_long),
            f"{theirs.ttft_long.ttft_s / ours.ttft_long.ttft_s:.1f}x faster",
        ),
        (
            "single stream: time to first token, short question",
            ms(theirs.single),
            ms(ours.single),
            f"{theirs.single.ttft_s / ours.single.ttft_s:.1f}x faster",
        ),
        (
            "single stream: decode tokens/s",
            f"{theirs.single.decode_tps:.2f}",
            f"{ours.single.decode_tps:.2f}",
            f"{ours.single.decode_tps / theirs.single.decode_tps:.2f}x",
        ),
        (
            "single stream: decode tokens/s vs in-process mlx-lm",
            f"{base_single.decode_tps:.2f} (mlx-lm, no HTTP)",
            f"{ours.single.decode_tps:.2f}",
            f"{ours.single.decode_tps / base_single.decode_tps:.2f}x",
        ),
        (
            f"{args.streams} streams: aggregate tokens/s",
            f"{theirs.aggregate:.2f}",
            f"{ours.aggregate:.2f}",
            f"{ours.aggregate / theirs.aggregate:.2f}x",
        ),
    ]
    if ours.free_json is not None and ours.schema_json is not None:
        free, held = ours.free_json.decode_tps, ours.schema_json.decode_tps
        rows.append(
            (
                "JSON answer: decode tokens/s, json_schema vs free (same cluster)",
                f"{free:.2f} (mlxpp, free)",
                f"{held:.2f}",
                f"{held / free:.2f}x" if free else "n/a",
            )
        )
    flags = " ".join(
        f"{flag} {value}"
        for flag, value in (
            ("--pp-micro-batch-size", args.micro_batch_size),
            ("--cpu-weights", args.cpu_weights),
        )
        if value is not None
    )
    print(
        f"\n{model_dir.name}: mlxppd serve --pp-size {args.pp_size} {flags or '(default flags)'} "
        f"(one process per stage, loopback, encrypted transport) against mlx_lm.server as "
        f"shipped; max_tokens {args.max_tokens}\n"
    )
    print(f"| measure | mlx_lm.server | mlxpp --pp-size {args.pp_size} | mlxpp vs baseline |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if native is not None:
        print_weights_table(theirs, native, ours, args)
    return 0


def print_weights_table(
    theirs: ServerRun, native: ServerRun, ours: ServerRun, args: argparse.Namespace
) -> None:
    """Prefill (the long prompt's tokens over its time to first token) and decode speed of the
    same cluster on the checkpoint's weights and on float32 (the default here), same run."""
    print(f"\nWeights, same run (mlxpp --pp-size {args.pp_size}, otherwise default flags)\n")
    print("| server | weights | prefill tokens/s | decode tokens/s | prefill vs mlx_lm.server |")
    print("|---|---|---:|---:|---:|")
    base = theirs.ttft_long
    for name, weights, run in (
        ("mlx_lm.server", "as stored, wheel's BLAS", theirs),
        ("mlxpp", "native (--cpu-weights native)", native),
        ("mlxpp", "float32 (auto)", ours),
    ):
        long = run.ttft_long
        prefill = long.prompt_tokens / long.ttft_s if long.prompt_tokens else 0.0
        print(
            f"| {name} | {weights} | {prefill:.1f} | {run.single.decode_tps:.2f} "
            f"| {base.ttft_s / long.ttft_s:.1f}x |"
        )


if __name__ == "__main__":
    sys.exit(main())
