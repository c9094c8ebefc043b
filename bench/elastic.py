"""Elastic repartition on a live cluster: how long each phase takes, how much each stage reads.

    .venv/bin/python bench/elastic.py [--model DIR] [--plans 0-9,10-29 0-19,20-29 0-14,15-29]

Starts a three-process cluster on loopback (the coordinator and two stage agents, each from its
own config directory with [cluster.elastic] enabled), then runs one explicit repartition per
plan with `mlxppctl repartition --pp-layers PLAN --wait` while a client keeps requests coming.
For each it prints the drain, rebalance and resume seconds from the repartition events, and per
stage the tensors read from the checkpoint and the tensors kept from before. The baseline,
measured in the same run, is what the reference engine does: each stage loading its whole new
range from scratch (seconds and tensors), in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent

CLUSTER = """\
[cluster]
name = "bench-elastic"
pipeline_parallel_size = 2
secret_file = "{secret}"
layers = ["0-14", "15-29"]

[cluster.elastic]
enabled = true
drain_timeout_s = 120.0

[[nodes]]
id = "coordinator"
address = "127.0.0.1:{p0}"
role = "hybrid"

[[nodes]]
id = "stage-0"
address = "127.0.0.1:{p1}"
role = "pipeline_stage"
stage = 0

[[nodes]]
id = "stage-1"
address = "127.0.0.1:{p2}"
role = "pipeline_stage"
stage = 1
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ctl(config_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "mlxppctl"), *args, "--config-dir", str(config_dir)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def wait_healthy(config_dir: Path, timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = ctl(config_dir, "status", "--json")
        if done.returncode == 0:
            document: dict[str, Any] = json.loads(done.stdout)
            if document.get("health") == "healthy":
                return document
        time.sleep(0.5)
    raise SystemExit("the cluster did not become healthy; see the agent logs")


def local_loads(model_dir: Path, before: str, after: str) -> list[dict[str, float]]:
    """In this process, per stage: the new range loaded from nothing (the reference engine's
    way) and loaded reusing the old range's tensors (ours), tensors and seconds for each."""
    from mlxppd.core.layer_ranges import parse_pp_layers
    from mlxppd.core.profile.model import read_model_config
    from mlxppd.core.stages import StageSpec
    from mlxppd.engine.stage import load_stage

    config = read_model_config(model_dir)
    old_ranges, new_ranges = parse_pp_layers(before, 30), parse_pp_layers(after, 30)
    out = []
    for i, (old, new) in enumerate(zip(old_ranges, new_ranges, strict=True)):
        n = len(new_ranges)
        held = load_stage(model_dir, StageSpec(i, n, old.start, old.end), config)
        started = time.perf_counter()
        full = load_stage(model_dir, StageSpec(i, n, new.start, new.end), config)
        full_s = time.perf_counter() - started
        del full
        started = time.perf_counter()
        ours = load_stage(model_dir, StageSpec(i, n, new.start, new.end), config, reuse=held)
        ours_s = time.perf_counter() - started
        out.append({
            "full_tensors": float(ours.loaded_tensors + ours.reused_tensors),
            "full_s": full_s, "ours_tensors": float(ours.loaded_tensors), "ours_s": ours_s,
        })  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    parser.add_argument("--plans", nargs="+", default=["0-9,10-29", "0-19,20-29", "0-14,15-29"])
    args = parser.parse_args()
    from mlxppd.engine.model_files import resolve_model_dir
    from mlxppd.wire.node_key import write_new_node_key

    model_dir = resolve_model_dir(args.model)
    root = Path(tempfile.mkdtemp(prefix="mlxpp-bench-elastic-"))
    secret = root / "cluster.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    ports = [free_port() for _ in range(3)]
    http = free_port()
    text = CLUSTER.format(secret=secret, p0=ports[0], p1=ports[1], p2=ports[2])
    nodes = ("stage-1", "stage-0", "coordinator")
    # Each node its own key (node.key, where an agent looks), the roster listing them all.
    keys = {}
    for node in nodes:
        (root / node).mkdir()
        keys[node] = write_new_node_key(root / node / "node.key").public_text
    text += "\n[roster]\n" + "".join(f'"{n}" = "{k}"\n' for n, k in keys.items())
    processes = []
    dirs = []
    for node in nodes:
        etc = root / node
        (etc / "cluster.toml").write_text(text)
        model = f'model = "{model_dir}"\n'
        (etc / "mlxppd.toml").write_text(f'node_id = "{node}"\nhttp_port = {http}\n{model}')
        log = (root / f"{node}.log").open("wb")
        processes.append(
            subprocess.Popen(
                [str(BIN / "mlxppd"), "agent", "--config-dir", str(etc)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
        dirs.append(etc)
    coordinator_dir = dirs[-1]
    url = f"http://127.0.0.1:{http}"
    stop = threading.Event()
    served = {"ok": 0, "refused": 0}

    def client() -> None:
        body = {"messages": [{"role": "user", "content": "List three colors."}],
                "max_tokens": 16, "temperature": 0}  # fmt: skip
        while not stop.is_set():
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
            if r.status_code == 503:
                served["refused"] += 1
                time.sleep(float(r.headers.get("Retry-After", "1")))
            else:
                served["ok"] += 1

    try:
        wait_healthy(coordinator_dir)
        worker = threading.Thread(target=client, daemon=True)
        worker.start()
        rows = []
        current = "0-14,15-29"
        for plan in args.plans:
            time.sleep(2.0)  # requests in flight when the trigger comes
            done = ctl(coordinator_dir, "repartition", "--pp-layers", plan, "--wait")
            if done.returncode != 0:
                print(done.stdout, done.stderr, file=sys.stderr)
                raise SystemExit(f"the repartition to {plan} failed")
            phases = {}
            for line in done.stdout.splitlines()[1:]:
                name = line.split(" -> ")[0]
                phases[name] = float(line.split(" after ")[1].split(" s")[0])
            status = json.loads(ctl(coordinator_dir, "status", "--json").stdout)
            loads = status["coordinator"]["last_repartition_loads"]
            rows.append((plan, phases, loads, local_loads(model_dir, current, plan)))
            current = plan
        stop.set()
        worker.join(600)
    finally:
        stop.set()
        for p in processes:
            p.terminate()
        for p in processes:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()

    print(f"Elastic repartition of {model_dir.name} (2 stages; a client sending requests "
          f"throughout: {served['ok']} answered, {served['refused']} refused with Retry-After "
          "and retried)\n")  # fmt: skip
    print("On the cluster (agents, while serving): the repartition's phases and each stage's "
          "load.\n")  # fmt: skip
    print("| new plan | drain s | rebalance s | resume s | stage | tensors read | tensors kept "
          "| load s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for plan, phases, loads, _ in rows:
        for i, load in enumerate(loads):
            head = (
                f"| {plan} | {phases.get('draining', 0):.2f} | {phases.get('rebalancing', 0):.3f} "
                f"| {phases.get('resuming', 0):.2f} "
                if i == 0
                else "| | | | "
            )
            print(
                f"{head}| {i} | {load['loaded_tensors']} | {load['reused_tensors']} "
                f"| {load['load_s']:.2f} |"
            )
    print("\nBaseline, same run, in this process: each stage's new range loaded from nothing "
          "(the reference engine's way) vs reusing the old range's tensors (ours).\n")  # fmt: skip
    print(
        "| new plan | stage | full: tensors | full s | ours: tensors read | ours s | read ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for plan, _, _, local in rows:
        for i, row in enumerate(local):
            ratio = row["ours_tensors"] / row["full_tensors"] if row["full_tensors"] else 0.0
            print(
                f"| {plan if i == 0 else ''} | {i} | {row['full_tensors']:.0f} "
                f"| {row['full_s']:.3f} | {row['ours_tensors']:.0f} | {row['ours_s']:.3f} "
                f"| {ratio:.0%} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
