"""Protocol 2 (this tree) against protocol 1 (a baseline checkout) and a raw socket, in one run.

    .venv/bin/python bench/transport_versions.py [--quick] [--baseline-tree PATH]

(``bench/transport.py`` prints the same table after its own.) For a raw loopback socket,
protocol 1 (the tree at ``--baseline-tree``, default a temporary git worktree of b324e25:
HMAC proofs over the cluster secret, HKDF keys) and protocol 2 (this tree: Noise XXpsk3 with
per-node X25519 keys, AES-256-GCM records that rekey), it prints:

* handshake: from the TCP connect until ``connect()`` returns a usable channel (raw: the TCP
  connect alone), p50 and p99; the channel is closed outside the timing;
* decode step: the round trip of an 8 KiB message (1x1x4096 fp16): sent, echoed back by the
  peer as another 8 KiB message, received into a preallocated buffer; p50 and p99;
* prefill: 4 MiB messages (1x512x4096 fp16) one way, back to back, one small ack after the
  last; MB/s (10^6 bytes) of the median round, the slowest and fastest in brackets;
* v2/v1 ratios against the goals (decode step p50 <= 1.10x, prefill >= 0.90x), and the decode
  step on a protocol-2 channel whose both directions rekey every ``--rekey-after`` records
  (default 1000; 250 with ``--quick``, so a short run still rekeys a dozen times), with the
  p50 of the steps during which a rekey was sent or received.

A full run takes about a minute on an idle host; ``--quick`` (fewer of everything) about 15 s.

Method. The parent only schedules. Each version has a driver process started with PYTHONPATH
set to that version's tree, so it imports that tree's mlxppd and speaks its own API (protocol
1: ``WireConfig(cluster_name, node_id, secret)``; protocol 2: plus ``node_key=`` and
``roster=``, two throwaway keys derived from the run's random cluster secret); each driver
starts its peer (the listener) from the same tree. Drivers share one
CPU and peers another, as stages on different hosts do. Drivers and peers run on
``mlxppd.runtime.system.event_loop`` (uvloop where installed; ``MLXPP_EVENT_LOOP=asyncio``
for asyncio's own loop), the same file in both trees (the table names the loop each driver
ran). Everything is warmed up before timing,
and the parent asks the versions in turn for blocks of measurements (rotating who goes first),
so a noisy neighbour slows every row alike. The raw baseline sends length-prefixed frames on
the same loop and receives them with ``recv_into`` a preallocated buffer: no codec, no crypto.
Every timing is taken inside the drivers, with ``perf_counter``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

try:  # run as a script, bench/ is on sys.path; as ``-m bench.transport_versions``, the root is
    from transport_versions_driver import PREFILL_BYTES
except ImportError:
    from bench.transport_versions_driver import PREFILL_BYTES  # type: ignore[no-redef]

HERE = Path(__file__).resolve()
THIS_TREE = HERE.parents[1]
DRIVER = HERE.with_name("transport_versions_driver.py")
#: the last commit of protocol 1 (HMAC proofs over the cluster secret), the baseline
PROTOCOL_1_COMMIT = "b324e25"
STEP_GOAL, PREFILL_GOAL = 1.10, 0.90


# -- the parent ---------------------------------------------------------------------------------


@dataclass
class Target:
    label: str
    driver: str  # which driver process
    channel: str = "main"
    handshake_ns: list[int] = field(default_factory=list)
    step_ns: list[int] = field(default_factory=list)
    rekeyed_ns: list[int] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)


class DriverProcess:
    def __init__(self, target: str, tree: Path, args: list[str], env: dict[str, str]):
        env = dict(env, PYTHONPATH=str(tree))
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), "--driver", target, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(tree),
        )
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a driver exited early (rc {self.proc.wait()}); see stderr above")
        return cast(dict[str, Any], json.loads(line))

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def quit(self) -> None:
        assert self.proc.stdin is not None
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=15)
        except (subprocess.TimeoutExpired, OSError, ValueError):
            self.proc.kill()  # its peer ends too: its stdin, the driver's pipe, closes


@dataclass(frozen=True)
class Plan:
    handshakes: int
    handshake_block: int
    steps: int
    step_block: int
    prefill_rounds: int
    prefill_count: int


FULL = Plan(400, 20, 20000, 100, 15, 48)
QUICK = Plan(100, 10, 3000, 100, 7, 16)


def rotated(items: list[Target], turn: int) -> list[Target]:
    k = turn % len(items)
    return items[k:] + items[:k]


def measure(
    plan: Plan, baseline: Path, backend: str, rekey_after: int, cpus: tuple[int, int] | None
) -> tuple[dict[str, Target], dict[str, dict[str, Any]], dict[str, int]]:
    env = dict(os.environ, MLXPP_CLUSTER_SECRET=secrets.token_hex(32))
    args = ["--backend", backend, "--rekey-after", str(rekey_after)]
    if cpus is not None:
        args += ["--cpu", str(cpus[0]), "--peer-cpu", str(cpus[1])]
    drivers: dict[str, DriverProcess] = {}
    try:
        drivers["raw"] = DriverProcess("raw", THIS_TREE, args, env)
        drivers["v1"] = DriverProcess("secure", baseline, args, env)
        drivers["v2"] = DriverProcess("secure", THIS_TREE, args, env)
        targets = {
            "raw": Target("raw loopback socket", "raw"),
            "v1": Target("protocol 1", "v1"),
            "v2": Target("protocol 2", "v2"),
            "v2-rekey": Target(f"protocol 2, rekey every {rekey_after} records", "v2", "rekey"),
        }
        if "rekey" not in drivers["v2"].info["channels"]:
            del targets["v2-rekey"]
        connecting = [targets[t] for t in ("raw", "v1", "v2")]
        every = list(targets.values())
        for t in connecting:  # warm-up: imports, code paths, buffers, socket windows
            drivers[t.driver].ask(op="handshake", n=5)
            drivers[t.driver].ask(op="prefill", count=max(2, plan.prefill_count // 4))
        for t in every:
            drivers[t.driver].ask(op="step", n=300, channel=t.channel)
        turn = 0
        for _ in range(0, plan.handshakes, plan.handshake_block):
            for t in rotated(connecting, turn):
                got = drivers[t.driver].ask(op="handshake", n=plan.handshake_block)
                t.handshake_ns += got["ns"]
            turn += 1
        for _ in range(0, plan.steps, plan.step_block):
            for t in rotated(every, turn):
                got = drivers[t.driver].ask(op="step", n=plan.step_block, channel=t.channel)
                t.step_ns += got["ns"]
                t.rekeyed_ns += got["rekeyed_ns"]
            turn += 1
        for _ in range(plan.prefill_rounds):
            for t in rotated(connecting, turn):
                got = drivers[t.driver].ask(op="prefill", count=plan.prefill_count)
                t.prefill_s.append(got["s"])
            turn += 1
        rekeys = drivers["v2"].ask(op="rekeys") if "v2-rekey" in targets else {}
        return targets, {k: d.info for k, d in drivers.items()}, rekeys
    finally:
        for d in drivers.values():
            d.quit()


def pct(values: list[int], q: float) -> float:
    return float(np.percentile(np.array(values, dtype=np.float64), q)) if values else float("nan")


def mb_s(t: Target, plan: Plan, seconds: float | None = None) -> float:
    """MB/s of the median round (or of a round that took ``seconds``)."""
    seconds = float(np.median(t.prefill_s)) if seconds is None else seconds
    return PREFILL_BYTES * plan.prefill_count / seconds / 1e6


def render(
    targets: dict[str, Target],
    infos: dict[str, dict[str, Any]],
    rekeys: dict[str, int],
    plan: Plan,
    baseline: Path,
) -> str:
    labels = {
        "v1": f"protocol {infos['v1']['protocol']} ({baseline}, {describe(baseline)})",
        "v2": f"protocol {infos['v2']['protocol']} (this tree, {describe(THIS_TREE)})",
    }
    lines = [
        f"Transport versions ({plan.handshakes} handshakes, {plan.steps} decode steps, "
        f"{plan.prefill_rounds} prefill rounds of {plan.prefill_count} x 4 MiB each)",
        "",
        "| transport | handshake p50 ms | handshake p99 ms | 8 KiB step RTT p50 µs "
        "| step RTT p99 µs | prefill 4 MiB MB/s (slowest-fastest round) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, t in targets.items():
        hs = (
            f"{pct(t.handshake_ns, 50) / 1e6:.2f} | {pct(t.handshake_ns, 99) / 1e6:.2f}"
            if t.handshake_ns
            else "– | –"
        )
        bw = (
            f"{mb_s(t, plan):.0f} ({mb_s(t, plan, max(t.prefill_s)):.0f}-"
            f"{mb_s(t, plan, min(t.prefill_s)):.0f})"
            if t.prefill_s
            else "–"
        )
        lines.append(
            f"| {labels.get(key, t.label)} | {hs} | {pct(t.step_ns, 50) / 1e3:.1f} "
            f"| {pct(t.step_ns, 99) / 1e3:.1f} | {bw} |"
        )
    v1, v2 = targets["v1"], targets["v2"]
    step_ratio = pct(v2.step_ns, 50) / pct(v1.step_ns, 50)
    p99_ratio = pct(v2.step_ns, 99) / pct(v1.step_ns, 99)
    hs_ratio = pct(v2.handshake_ns, 50) / pct(v1.handshake_ns, 50)
    bw_ratio = mb_s(v2, plan) / mb_s(v1, plan)
    raw = targets["raw"]
    lines += [
        "",
        f"- v2/v1 decode-step p50: {step_ratio:.2f}x (goal <= {STEP_GOAL:.2f}x: "
        f"{'met' if step_ratio <= STEP_GOAL else 'MISSED'} in this run); p99: {p99_ratio:.2f}x",
        f"- v2/v1 prefill throughput: {bw_ratio:.2f}x (goal >= {PREFILL_GOAL:.2f}x: "
        f"{'met' if bw_ratio >= PREFILL_GOAL else 'MISSED'} in this run)",
        f"- v2/v1 handshake p50: {hs_ratio:.2f}x (no goal)",
        f"- against the raw socket: decode-step p50 v1 "
        f"{pct(v1.step_ns, 50) / pct(raw.step_ns, 50):.2f}x, v2 "
        f"{pct(v2.step_ns, 50) / pct(raw.step_ns, 50):.2f}x; prefill v1 "
        f"{mb_s(v1, plan) / mb_s(raw, plan):.0%}, v2 {mb_s(v2, plan) / mb_s(raw, plan):.0%}",
    ]
    if "v2-rekey" in targets:
        rk = targets["v2-rekey"]
        carried = (
            f"the {len(rk.rekeyed_ns)} steps that carried one: p50 "
            f"{pct(rk.rekeyed_ns, 50) / 1e3:.1f} µs"
            if rk.rekeyed_ns
            else "no timed step carried one (raise --steps or lower --rekey-after)"
        )
        lines.append(
            f"- rekeying: decode-step p50 {pct(rk.step_ns, 50) / pct(v2.step_ns, 50):.2f}x and "
            f"p99 {pct(rk.step_ns, 99) / pct(v2.step_ns, 99):.2f}x the protocol-2 channel that "
            f"does not rekey; {rekeys.get('sent', 0)} rekeys sent and "
            f"{rekeys.get('received', 0)} received on that channel in the run (warm-up "
            f"included); {carried}"
        )
    v2i = infos["v2"]
    lines.append(
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), Python {v2i['python']}, "
        f"cryptography {v2i['cryptography']} ({v2i['openssl']}), event loop "
        f"{v2i['loop']} (protocol 1's driver: {infos['v1']['loop']}); drivers from "
        f"{infos['v1']['mlxppd']} and {v2i['mlxppd']}"
    )
    return "\n".join(lines)


def describe(tree: Path) -> str:
    """The tree's commit, and whether its tracked files differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    return commit + (" + uncommitted changes" if git("status", "--porcelain", "-uno") else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_pair() -> tuple[int, int] | None:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def run_comparison(
    *,
    quick: bool,
    baseline: Path,
    backend: str = "tcp",
    rekey_after: int | None = None,
    cpus: tuple[int, int] | None = None,
) -> str:
    """Measure and render the table; ``cpus``: (drivers', peers') CPU, chosen before pinning."""
    if not (baseline / "mlxppd" / "wire" / "transport.py").is_file():
        raise SystemExit(f"--baseline-tree {baseline} holds no mlxppd checkout")
    plan = QUICK if quick else FULL
    rekey = rekey_after if rekey_after is not None else (250 if quick else 1000)
    targets, infos, rekeys = measure(plan, baseline, backend, rekey, cpus)
    return render(targets, infos, rekeys, plan, baseline)


@contextlib.contextmanager
def baseline_tree(given: Path | None) -> Iterator[Path]:
    """``given``, or a temporary checkout of protocol 1's last commit (removed after)."""
    if given is not None:
        yield given.resolve()
        return
    where = Path(tempfile.mkdtemp(prefix="mlxpp-protocol-1-")) / "tree"
    add = ["git", "-C", str(THIS_TREE), "worktree", "add", "--detach", str(where)]
    done = subprocess.run([*add, PROTOCOL_1_COMMIT], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"cannot check out protocol 1 ({PROTOCOL_1_COMMIT}) for the baseline: "
            f"{done.stderr.strip()}; pass --baseline-tree PATH to a checkout of it"
        )
    try:
        yield where
    finally:
        subprocess.run(
            ["git", "-C", str(THIS_TREE), "worktree", "remove", "--force", str(where)],
            capture_output=True,
        )
        shutil.rmtree(where.parent, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="the protocol-1 checkout to compare with (default: a temporary git worktree of "
        f"{PROTOCOL_1_COMMIT}, the last protocol-1 commit)",
    )
    parser.add_argument("--backend", default="tcp", choices=("tcp", "rdma"))
    parser.add_argument(
        "--rekey-after",
        type=int,
        help="records per key on the rekeying channel (default 1000; --quick 250)",
    )
    args = parser.parse_args(argv)
    started, load = time.perf_counter(), os.getloadavg()[0]
    with baseline_tree(args.baseline_tree) as baseline:
        table = run_comparison(
            quick=args.quick,
            baseline=baseline,
            backend=args.backend,
            rekey_after=args.rekey_after,
            cpus=cpu_pair(),
        )
    print(table)
    print(
        f"- run: {time.perf_counter() - started:.0f} s, load average {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (other work on the host skews the numbers)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
