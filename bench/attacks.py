"""How long hostile input stalls a live cluster's coordinator, measured by a probe.

    .venv/bin/python bench/attacks.py [--model DIR] [--pp-size 2] [--rounds 3]

Starts ``mlxppd serve --pp-size N`` and, for each attack, asks ``GET /health`` over and over
from another thread while the attack runs: a probe's latency is how long the coordinator's
event loop kept it waiting. The baseline is the same probe with no attack, measured in the
same run. Prints a markdown table: probe latency p50 and max per attack, the attack's answer.
Goal (the hardening issue): no probe waits over 100 ms under any attack.

Then the amplification attacks (issue 41), each beside its baseline in the same run:
- 4 streaming chat requests of ``n=4`` (the most the default ``--max-choices-per-request``
  gives) and of ``n=16`` (the cluster here allows 16) with ``top_logprobs=20`` from one client,
  then another client's 4-token completions, timed. Goal: the bystander within 3x its latency
  without the attack.
- 2,000 requests with a duplicate ``Host`` header: the bytes the log grew by against the bytes
  sent (goal: fewer), and ``mlxpp_http_rejected_total``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


def start_cluster(
    model_dir: Path, pp_size: int, log_path: Path
) -> tuple[subprocess.Popen[bytes], str]:
    ready = Path(tempfile.mkdtemp()) / "ready"
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--model", str(model_dir),
           "--pp-size", str(pp_size), "--port", "0", "--ready-file", str(ready), "--metrics",
           "--max-choices-per-request", "16"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError("the cluster did not start")
        time.sleep(0.1)
    return proc, ready.read_text().strip()


def eos_bias(model_dir: Path) -> dict[str, float]:
    """A logit_bias banning the model's end tokens: an attack stream runs until it is closed."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        if (path := model_dir / name).exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return {str(i): -100.0 for i in ids}


class Amplifier:
    """4 streaming chat requests of n=16 and top_logprobs=20 from one client, each read in a
    thread of its own until closed; their statuses (a 503 for those over the client's share)."""

    def __init__(self, base: str, bias: dict[str, float], requests: int = 4, n: int = 16) -> None:
        self.body = {
            "messages": [{"role": "user", "content": "Tell me a long story."}], "n": n,
            "max_tokens": 4000, "temperature": 1.0, "seed": 7, "logprobs": True,
            "top_logprobs": 20, "logit_bias": bias, "stream": True,
        }  # fmt: skip
        self.client = httpx.Client(base_url=base, timeout=120)
        self.statuses: list[int] = []
        self.started = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(requests)]

    def _run(self) -> None:
        with contextlib.suppress(httpx.HTTPError, OSError):
            with self.client.stream("POST", "/v1/chat/completions", json=self.body) as response:
                self.statuses.append(response.status_code)
                self.started.release()
                for _ in response.iter_lines():
                    pass
        self.started.release()

    def __enter__(self) -> Amplifier:
        for thread in self.threads:
            thread.start()
        for _ in self.threads:
            self.started.acquire(timeout=300)
        time.sleep(1.0)  # the admitted streams are decoding
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()  # closes the streams: their sequences end
        for thread in self.threads:
            thread.join(30)


def bystander_latencies(base: str, rounds: int) -> list[float]:
    """``rounds`` 4-token greedy completions from another address (127.0.0.2), one at a time."""
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    out = []
    with httpx.Client(base_url=base, timeout=300, transport=transport) as client:
        for _ in range(rounds):
            started = time.perf_counter()
            response = client.post("/v1/completions", json={**BENIGN, "max_tokens": 4})
            response.raise_for_status()
            out.append(time.perf_counter() - started)
    return out


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=60).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def duplicate_hosts(base: str, count: int) -> int:
    """``count`` requests with two Host headers, one connection each; the bytes sent."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    request = b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n"
    for _ in range(count):
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(request)
            sock.recv(64)
    return count * len(request)


def amplification(base: str, model_dir: Path, log_path: Path, rounds: int) -> None:
    print("\n| attack | answers | bystander p50 ms | bystander max ms | vs. no attack |")
    print("|---|---|---:|---:|---:|")
    alone = bystander_latencies(base, rounds)
    p50 = statistics.median(alone)
    print(f"| none (baseline) | - | {p50 * 1e3:.0f} | {max(alone) * 1e3:.0f} | 1.00x |")
    # n=4 is the most a request gets at the default --max-choices-per-request; n=16 is the
    # issue's attack, on a cluster whose operator allows it.
    for n in (4, 16):
        with Amplifier(base, eos_bias(model_dir), n=n) as attack:
            during = bystander_latencies(base, rounds)
            answers = ", ".join(str(s) for s in sorted(attack.statuses))
            in_flight = metric(base, "mlxpp_http_sequences_in_flight")
        print(
            f"| 4 x n={n} x top_logprobs=20, streaming ({in_flight:.0f} sequences in flight) | "
            f"{answers} | {statistics.median(during) * 1e3:.0f} | {max(during) * 1e3:.0f} | "
            f"{statistics.median(during) / p50:.2f}x |"
        )
        while metric(base, "mlxpp_http_sequences_in_flight") > 0:  # the closed streams end
            time.sleep(0.2)
    before_log = log_path.stat().st_size
    before_count = metric(base, "mlxpp_http_rejected_total")
    sent = duplicate_hosts(base, 2000)
    time.sleep(0.5)
    grown = log_path.stat().st_size - before_log
    counted = metric(base, "mlxpp_http_rejected_total") - before_count
    print("\n| attack | bytes sent | log grew, bytes | log / sent | counted |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| 2,000 duplicate-Host requests | {sent:,} | {grown:,} | {grown / sent:.3f} | "
        f"{counted:,.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--pp-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="times each attack is run")
    args = parser.parse_args(argv)

    from mlxppd.engine.model_files import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    log_path = Path(tempfile.mkdtemp()) / "cluster.log"
    proc, base = start_cluster(model_dir, args.pp_size, log_path)
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
        amplification(base, model_dir, log_path, args.rounds * 3)
    finally:
        proc.send_signal(2)
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
