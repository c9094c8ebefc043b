"""How long a lost stage pauses its clients: SIGKILL a stage mid-stream, five times.

    .venv/bin/python bench/failover.py [--model DIR] [--pp-size 3] [--runs 5] [--max-tokens 64]

Starts ``mlxppd serve --pp-size N`` (its supervisor restarts a dead stage process on its port,
the coordinator reconnects and replays). Each run streams two greedy chats, SIGKILLs stage 1
after the 10th chunk of the first, and records the coordinator's recovery time (from its
``failover: reconnected after N s`` line) and each client's longest pause between two chunks.
The baseline is the same streams' longest pause with no failure, measured in the same run.
Every stream must end with the text of the undisturbed run. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

QUESTIONS = ["Tell me a story about a dragon.", "Explain how a steam engine works."]


def stream(url: str, question: str, max_tokens: int, on_chunk: object = None) -> tuple[str, float]:
    """The streamed text and the longest gap between two chunks, seconds."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    text, gaps, last, chunks = "", [0.0], time.monotonic(), 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            event = __import__("json").loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event["choices"]:
                text += event["choices"][0]["delta"].get("content") or ""
            chunks += 1
            if callable(on_chunk):
                on_chunk(chunks)
    return text, max(gaps[2:] or [0.0])  # from the third chunk: past the prefill


def both(url: str, max_tokens: int, kill_pid: int | None) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = [("", 0.0)] * len(QUESTIONS)

    def on_chunk(n: int) -> None:
        if kill_pid is not None and n == 10:
            os.kill(kill_pid, signal.SIGKILL)

    def run(i: int) -> None:
        out[i] = stream(url, QUESTIONS[i], max_tokens, on_chunk if i == 0 else None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def stage_pid(log: str, stage: int) -> int:
    pids = re.findall(rf"(?:starting|restarted) stage {stage}/\d+ \(pid (\d+)\)", log)
    return int(pids[-1])


def wait_for(pattern: str, log_path: Path, count: int, timeout: float = 300) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(found := re.findall(pattern, log_path.read_text())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {pattern!r} #{count}")
        time.sleep(0.1)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--pp-size", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="mlxpp-failover-bench-"))
    ready, log_path = work / "ready", work / "cluster.log"
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--pp-size",
           str(args.pp_size), "--port", "0", "--ready-file", str(ready)]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(log_path.read_text()[-3000:])
            time.sleep(0.1)
        url = ready.read_text().strip()
        baseline = both(url, args.max_tokens, None)
        recoveries, pauses = [], []
        for run in range(1, args.runs + 1):
            victim = stage_pid(log_path.read_text(), 1)
            results = both(url, args.max_tokens, victim)
            if [t for t, _ in results] != [t for t, _ in baseline]:
                raise RuntimeError(f"run {run}: a stream's text changed across the failover")
            found = wait_for(r"failover: reconnected after ([\d.]+) s", log_path, run)
            recoveries.append(float(found[-1]))
            pauses.append(max(p for _, p in results))
            wait_for(r"stage 1 listening on", log_path, run + 1)
            print(f"run {run}: recovery {recoveries[-1]:.1f} s, client pause "
                  f"{pauses[-1]:.1f} s", file=sys.stderr)  # fmt: skip
        base_pause = max(p for _, p in baseline)
        print(f"| measure ({args.runs} runs, pp {args.pp_size}) | p50 | max |")
        print("|---|---:|---:|")
        print(f"| coordinator recovery, s | {statistics.median(recoveries):.1f} | "
              f"{max(recoveries):.1f} |")  # fmt: skip
        print(f"| client's longest pause, s | {statistics.median(pauses):.1f} | "
              f"{max(pauses):.1f} |")  # fmt: skip
        print(f"| baseline: longest pause, no failure, s | {base_pause:.2f} | {base_pause:.2f} |")
        print("\nevery stream's text equals the undisturbed run's: True")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
