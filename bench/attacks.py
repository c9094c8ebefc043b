"""How long hostile input stalls a live cluster's coordinator, measured by a probe.

    .venv/bin/python bench/attacks.py [--model DIR] [--pp-size 2] [--rounds 3]

Starts ``mlxppd serve --pp-size N`` and, for each attack, asks ``GET /health`` over and over
from another thread while the attack runs: a probe's latency is how long the coordinator's
event loop kept it waiting. The baseline is the same probe with no attack, measured in the
same run. Prints a markdown table: probe latency p50 and max per attack, the attack's answer.
Goal (the hardening issue): no probe waits over 100 ms under any attack.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

MIB = 1024 * 1024
BENIGN = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


class Probe:
    """``GET /health`` back to back on one keep-alive connection; latencies in seconds."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                client.get("/health")
                self.latencies.append(time.perf_counter() - started)
                time.sleep(0.005)

    def __enter__(self) -> Probe:
        self._thread.start()
        time.sleep(0.2)  # probing before the attack starts
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.2)
        self._stop.set()
        self._thread.join()


def post_raw(base: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> str:
    response = httpx.post(
        f"{base}{path}",
        content=body,
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout=120,
    )
    return str(response.status_code)


def tiny_messages(base: str) -> str:
    tiny = b'{"role":"user","content":"a"},'
    count = (4 * MIB - 64) // len(tiny)
    body = b'{"messages":[' + tiny * (count - 1) + tiny[:-1] + b'],"max_tokens":4}'
    return post_raw(base, "/v1/chat/completions", body)


def deep_nesting(base: str) -> str:
    return post_raw(base, "/v1/completions", b'{"prompt":' + b"[" * 200_000 + b"]" * 200_000 + b"}")


def huge_stops(base: str) -> str:
    body = httpx.Request("POST", "/", json={**BENIGN, "stop": ["x" * MIB] * 4}).read()
    return post_raw(base, "/v1/completions", body)


def bad_header(base: str) -> str:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
            b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
        )
        answer = sock.recv(64)
    return answer.split(b" ", 2)[1].decode()


def slowloris(base: str) -> str:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
    try:
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
            for sock in socks:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    pass
            time.sleep(0.05)
    finally:
        for sock in socks:
            sock.close()
    return "200 held"


def idle(base: str) -> str:
    time.sleep(1.0)
    return "-"


ATTACKS: list[tuple[str, Callable[[str], str]]] = [
    ("none (baseline)", idle),
    ("4 MiB of tiny chat messages", tiny_messages),
    ("200,000-deep JSON nesting", deep_nesting),
    ("four 1 MiB stop strings", huge_stops),
    ("non-UTF-8 Authorization header", bad_header),
    ("slowloris: 200 connections, a byte at a time", slowloris),
]


def start_cluster(model_dir: Path, pp_size: int) -> tuple[subprocess.Popen[bytes], str]:
    ready = Path(tempfile.mkdtemp()) / "ready"
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--model", str(model_dir),
           "--pp-size", str(pp_size), "--port", "0", "--ready-file", str(ready),
           "--log-level", "WARNING"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError("the cluster did not start")
        time.sleep(0.1)
    return proc, ready.read_text().strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--pp-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="times each attack is run")
    args = parser.parse_args(argv)

    from mlxppd.engine.model_files import resolve_model_dir

    proc, base = start_cluster(resolve_model_dir(args.model), args.pp_size)
    try:
        before = httpx.post(f"{base}/v1/completions", json=BENIGN, timeout=120).json()
        print("| attack | answer | probes | probe p50 ms | probe max ms |")
        print("|---|---|---:|---:|---:|")
        for name, attack in ATTACKS:
            latencies: list[float] = []
            answers = set()
            for _ in range(args.rounds):
                with Probe(base) as probe:
                    answers.add(attack(base))
                latencies += probe.latencies
            print(
                f"| {name} | {', '.join(sorted(answers))} | {len(latencies)} | "
                f"{statistics.median(latencies) * 1e3:.1f} | {max(latencies) * 1e3:.1f} |"
            )
        after = httpx.post(f"{base}/v1/completions", json=BENIGN, timeout=120).json()
        same = after["choices"][0]["text"] == before["choices"][0]["text"]
        print(f"\nthe benign greedy completion after every attack is unchanged: {same}")
    finally:
        proc.send_signal(2)
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
