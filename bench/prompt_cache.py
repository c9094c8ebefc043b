"""Time to first token over a 3-turn chat, with and without the prompt cache, in one run.

    .venv/bin/python bench/prompt_cache.py [--model DIR] [--pp-size 2] [--max-tokens 32]

The same conversation (a first turn carrying a 417-token context, then two short follow-ups;
each turn's prompt is the whole conversation so far, as chat clients send it) goes to:
- ``mlxppd serve --pp-size N`` with its defaults (every stage keeps recent prompt prefixes);
- the same cluster with ``--prompt-cache-entries 0`` (every turn prefilled in full): the
  baseline the cache is measured against;
- ``mlx_lm.server``, which keeps its own prompt cache, as users run it.
Each turn streams over HTTP; the table gives its time to first token, the prompt tokens the
server reports as cached, and the ratio to the uncached cluster. The answers of the two
clusters are compared: the cache must not change the text (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prompts import CHAT_PROMPT
from serve import free_port, stop, wait_http

from mlxppd.engine.embedded import default_cache_dir, ensure_embedded_model

FOLLOW_UPS = ["Summarize that in two sentences.", "What should I try next week?"]


def turn(base: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed turn: time to first token, the text, the usage."""
    body = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    first, text, usage = 0.0, "", {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and not first:
                    first = time.perf_counter()
                text += piece
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "ttft_s": first - started,
        "text": text,
        "prompt_tokens": (usage or {}).get("prompt_tokens", 0),
        "cached": details.get("cached_tokens", 0),
    }


def chat(base: str, model: str, max_tokens: int) -> list[dict[str, Any]]:
    messages: list[dict[str, str]] = []
    out = []
    for question in [CHAT_PROMPT, *FOLLOW_UPS]:
        messages.append({"role": "user", "content": question})
        result = turn(base, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": result["text"]})
        out.append(result)
    return out


def cluster(model_dir: Path, pp_size: int, max_tokens: int, *extra: str) -> list[dict[str, Any]]:
    ready = Path(tempfile.mkdtemp()) / "ready"
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--model", str(model_dir),
           "--pp-size", str(pp_size), "--port", "0", "--ready-file", str(ready),
           "--log-level", "WARNING", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError("the cluster did not start")
            time.sleep(0.1)
        base = ready.read_text().strip()
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        return chat(base, model, max_tokens)
    finally:
        stop(proc)


def mlx_lm_server(model_dir: Path, max_tokens: int) -> list[dict[str, Any]]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base, "/v1/models", server)
        return chat(base, str(model_dir), max_tokens)
    finally:
        stop(server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--pp-size", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model = args.model or ensure_embedded_model(default_cache_dir())
    cached = cluster(model, args.pp_size, args.max_tokens)
    uncached = cluster(model, args.pp_size, args.max_tokens, "--prompt-cache-entries", "0")
    reference = mlx_lm_server(model, args.max_tokens)
    print(f"\nmodel {model.name}, serve --pp-size {args.pp_size}, {args.max_tokens} tokens/turn\n")
    print("| turn | prompt tokens | cached | TTFT cache (s) | TTFT no cache (s) | ratio "
          "| mlx_lm.server TTFT (s) | same text |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for i, (a, b, c) in enumerate(zip(cached, uncached, reference, strict=True), 1):
        print(
            f"| {i} | {a['prompt_tokens']} | {a['cached']} | {a['ttft_s']:.2f} | "
            f"{b['ttft_s']:.2f} | {a['ttft_s'] / b['ttft_s']:.2f}x | {c['ttft_s']:.2f} | "
            f"{'yes' if a['text'] == b['text'] else 'NO'} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
