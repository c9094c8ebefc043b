"""Measured pipeline bubble of a local cluster next to GPipe's theoretical (k-1)/(m+k-1).

    .venv/bin/python bench/bubble.py [--model DIR] [--max-tokens 16]

For k = 2 and 3 stages and m = 1, 2, 4, 8 concurrent sequences (each its own micro-batch), runs
the m requests and reads every stage's busy and active seconds from the coordinator's /metrics
before and after. A stage's bubble is the share of its active time (while it holds sequences)
spent not computing; the table shows the mean over stages. The theoretical figure is for one
GPipe pass of m micro-batches; a continuously decoding pipeline keeps m sequences cycling, so
with m >= k it can do better than one pass would.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from mlxppd.core.schedule import bubble_fraction

QUESTIONS = [
    "Tell me about the sea.",
    "Describe a forest.",
    "Explain rain.",
    "Write about the moon.",
    "Describe a city at night.",
    "Tell me about mountains.",
    "Explain wind.",
    "Describe a desert.",
]


def counters(base: str) -> dict[str, dict[str, float]]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, dict[str, float]] = {"busy": {}, "active": {}}
    for kind, metric in (("busy", "busy"), ("active", "active")):
        pattern = rf'^mlxpp_pp_stage_{metric}_seconds_total{{stage="(\d+)"}} (\S+)$'
        for stage, value in re.findall(pattern, text, re.M):
            out[kind][stage] = float(value)
    return out


def run_requests(base: str, m: int, max_tokens: int) -> None:
    def ask(q: str) -> None:
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens}
        httpx.post(f"{base}/v1/chat/completions", json={**body, "temperature": 0}, timeout=600)

    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS[:m]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(model: str | None, k: int, ms: list[int], max_tokens: int) -> dict[int, float]:
    ready = Path(tempfile.mkdtemp()) / "ready"
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--pp-size", str(k)]
    cmd += ["--port", "0", "--metrics", "--ready-file", str(ready), "--log-level", "WARNING"]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError("the cluster did not start")
            time.sleep(0.1)
        base = ready.read_text().strip()
        out = {}
        for m in ms:
            time.sleep(2.5)  # the coordinator polls stages once a second
            before = counters(base)
            run_requests(base, m, max_tokens)
            time.sleep(2.5)
            after = counters(base)
            bubbles = []
            for stage in after["busy"]:
                busy = after["busy"][stage] - before["busy"][stage]
                active = after["active"][stage] - before["active"][stage]
                bubbles.append(1 - busy / active if active > 0 else 0.0)
            out[m] = sum(bubbles) / len(bubbles)
            print(f"k={k} m={m}: mean bubble {out[m]:.3f}", file=sys.stderr)
        return out
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    ms = [1, 2, 4, 8]
    rows = {k: measure(args.model, k, ms, args.max_tokens) for k in (2, 3)}
    print("\n| stages k | sequences m | measured mean bubble | theoretical (k-1)/(m+k-1) |")
    print("|---:|---:|---:|---:|")
    for k, measured in rows.items():
        for m in ms:
            print(f"| {k} | {m} | {measured[m]:.3f} | {float(bubble_fraction(k, m)):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
