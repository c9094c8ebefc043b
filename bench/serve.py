"""Serving speed of a local mlxpp cluster against mlx-lm, measured in one run.

    .venv/bin/python bench/serve.py [--model DIR] [--pp-size 2] [--max-tokens 48] [--streams 8]

Prints a markdown table:
- single stream: time to first token and decode tokens/s of the cluster (over HTTP, streaming)
  against single-process mlx-lm (``generate_step`` in this process, no HTTP);
- N concurrent streams: aggregate generated tokens/s of the cluster against ``mlx_lm.server``
  serving the same N requests.
Goals: single-stream decode >= 0.9x mlx-lm; aggregate >= 1.0x mlx_lm.server.
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

import httpx

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stream_chat(base: str, model: str, question: str, max_tokens: int) -> StreamResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = 0.0
    chunks = 0
    tokens = 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    wall = time.perf_counter() - start
    tokens = tokens or chunks
    decode = (tokens - 1) / (last - first) if last > first and tokens > 1 else 0.0
    return StreamResult(first - start, decode, tokens, wall)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--pp-size", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument(
        "--micro-batch-size", type=int, default=4, help="--pp-micro-batch-size of the cluster"
    )
    args = parser.parse_args(argv)

    from mlxppd.engine.model_files import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    rows: list[tuple[str, str, str, str]] = []

    base_single = mlx_lm_single(model_dir, args.max_tokens)
    print("mlx-lm single stream measured", file=sys.stderr)

    # mlxpp local cluster
    ready = Path(tempfile.mkdtemp()) / "ready"
    cluster = subprocess.Popen(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--model", str(model_dir),
         "--pp-size", str(args.pp_size), "--port", "0", "--ready-file", str(ready),
         "--pp-micro-batch-size", str(args.micro_batch_size), "--log-level", "WARNING"],
        env=env,
    )  # fmt: skip
    try:
        while not ready.exists():
            if cluster.poll() is not None:
                raise RuntimeError("the cluster did not start")
            time.sleep(0.1)
        base = ready.read_text().strip()
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        stream_chat(base, model, QUESTIONS[0], 8)  # warm
        single = stream_chat(base, model, QUESTIONS[0], args.max_tokens)
        stream_chat(base, model, QUESTIONS[1], 8)
        cluster_agg = concurrent(base, model, args.streams, args.max_tokens)
        print("cluster measured", file=sys.stderr)
    finally:
        stop(cluster)

    # mlx_lm.server with the same requests
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        sbase = f"http://127.0.0.1:{port}"
        wait_http(sbase, "/v1/models", server)
        smodel = str(model_dir)
        stream_chat(sbase, smodel, QUESTIONS[0], 8)  # warm
        server_agg = concurrent(sbase, smodel, args.streams, args.max_tokens)
        print("mlx_lm.server measured", file=sys.stderr)
    finally:
        stop(server)

    rows.append(
        (
            "single stream: time to first token",
            f"{base_single.ttft_s * 1000:.0f} ms (mlx-lm)",
            f"{single.ttft_s * 1000:.0f} ms",
            f"{base_single.ttft_s / single.ttft_s:.2f}x speed",
        )
    )
    rows.append(
        (
            "single stream: decode tokens/s",
            f"{base_single.decode_tps:.2f} (mlx-lm)",
            f"{single.decode_tps:.2f}",
            f"{single.decode_tps / base_single.decode_tps:.2f}x",
        )
    )
    rows.append(
        (
            f"{args.streams} streams: aggregate tokens/s",
            f"{server_agg:.2f} (mlx_lm.server)",
            f"{cluster_agg:.2f}",
            f"{cluster_agg / server_agg:.2f}x",
        )
    )
    print(
        f"\n{model_dir.name}, {args.pp_size}-stage local cluster (one process per stage, "
        f"loopback, encrypted transport, micro-batches of up to {args.micro_batch_size}), "
        f"max_tokens {args.max_tokens}\n"
    )
    print(f"| measure | baseline | mlxpp --pp-size {args.pp_size} | ratio |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
