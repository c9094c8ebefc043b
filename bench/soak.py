"""A bounded chaos soak of a live local cluster: faults under load, nothing lost, memory flat.

    .venv/bin/python bench/soak.py [--model DIR] [--pp-size 3] [--minutes 10 | --seconds S]
        [--clients 4] [--fault-every 60] [--max-tokens 32] [--request-timeout 120]

Starts ``mlxppd serve --pp-size N --port 0`` (its supervisor restarts a dead stage process on
its port, the coordinator's failover reconnects and replays) with a fresh cluster secret and
``--enable-elastic-pp`` on a block of free transport ports of its own (other local clusters take
theirs from the default range), everything it writes in one temp dir. First the greedy reference
answer of each of a fixed set of prompts, one at a time and undisturbed (the baseline, same
run); then for the soak's duration C client threads loop: a prompt, a chat request (every other
one streamed; the impatient clients close some streams after a few chunks, which counts as
"closed early" once the text so far is a prefix of the reference), and the answer must equal the
reference exactly. Meanwhile a fault thread waits for ``/health`` and then injects, every
``--fault-every`` seconds, the next fault of a rotating list: SIGKILL a stage process, SIGSTOP a
stage for twice the heartbeat timeout then SIGCONT, a repartition (``mlxppctl repartition
--pp-layers ... --wait``) and a drain (``mlxppctl drain``, a few seconds, ``mlxppctl resume``);
the two admin faults are skipped with a note when the signed admin API does not answer. A
sampler reads every process's RSS (``/proc/PID/status``) and open fds (``/proc/PID/fd``), the
serve process and its descendants, every few seconds. At the end the references again, and a
markdown table: requests and their outcomes, faults, the recoveries the serve log reports, RSS
and fds per process (after warm-up vs end, under the same load) and the log's ERROR lines.

Exit status 0 only when no answer was wrong, failed or hung and the final references are exact.
All traffic goes to 127.0.0.1. Ctrl-C, SIGTERM or an error stops everything it started.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

BIN = Path(sys.executable).parent
PROMPTS = [
    "Tell me a story about a dragon who learns to play the violin.",
    "Explain in detail how a steam engine works.",
    "Describe the water cycle step by step.",
    "Write a poem about the sea.",
    "Explain how computers store numbers.",
    "Describe a day in the life of a medieval farmer.",
    "Explain photosynthesis to a child.",
    "Tell me about the history of the bicycle.",
]
#: the local cluster's failover settings are the defaults (docs/failover.md)
HEARTBEAT_TIMEOUT_S = 5.0
FAULTS = ["sigkill", "sigstop", "repartition", "drain"]
FAILOVER_LINE = re.compile(r"failover: (reconnected|standby|survivors|failed) after ([\d.]+) s")
MAX_RETRIES = 100  # 503 + Retry-After answers one request may retry, within its deadline


# ---------------------------------------------------------------------------------------------
# /proc


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the comm may hold spaces and parentheses
    return fields[0], int(fields[1])


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (children first)."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents[st[1]].append(int(entry))
    out, todo = [], [root]
    for _ in range(10_000):  # bounded walk
        if not todo:
            break
        for child in parents.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def role(pid: int, root: int) -> str:
    """``coordinator`` for the serve process, the ``--node-id`` of a stage, else the name."""
    if pid == root:
        return "coordinator"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--node-id" in argv:
            return argv[argv.index(b"--node-id") + 1].decode()
        return Path(f"/proc/{pid}/comm").read_text().strip() + f"[{pid}]"
    except (OSError, IndexError):
        return f"?[{pid}]"


def stage_pid(root: int, index: int) -> int | None:
    for pid in descendants(root):
        if role(pid, root) == f"stage-{index}":
            return pid
    return None


def usage(pid: int) -> tuple[int, int] | None:
    """(RSS in KiB, open fds) of a process, None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return (int(match.group(1)) if match else 0), fds


# ---------------------------------------------------------------------------------------------
# requests


@dataclass
class Outcome:
    kind: str  # "ok", "wrong", "failed", "hung", "closed"
    text: str = ""
    detail: str = ""
    seconds: float = 0.0
    retries: int = 0


def chat(url: str, prompt: str, args: argparse.Namespace, stream: bool,
         close_after: int | None = None) -> tuple[str, str, int]:  # fmt: skip
    """One chat request: (kind, text or message, 503 answers retried). ``kind`` is "ok",
    "closed" (``close_after`` chunks read, then closed), "failed" or "hung"."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": 0, "stream": stream}  # fmt: skip
    deadline = time.monotonic() + args.request_timeout
    retries = 0
    for _ in range(MAX_RETRIES + 1):
        left = deadline - time.monotonic()
        if left <= 0:
            return "hung", f"no answer in {args.request_timeout:g} s", retries
        timeout = httpx.Timeout(left, connect=min(10.0, left))
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                              timeout=timeout) as r:  # fmt: skip
                if r.status_code == 503 and "retry-after" in r.headers:
                    retries += 1
                    pause = min(float(r.headers["retry-after"]), 5.0)
                    time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
                    continue
                if r.status_code != 200:
                    return "failed", f"HTTP {r.status_code}: {r.read().decode()[:200]}", retries
                if not stream:
                    data = json.loads(r.read())
                    return "ok", data["choices"][0]["message"]["content"] or "", retries
                text, chunks, done = "", 0, False
                for line in r.iter_lines():
                    if time.monotonic() > deadline:
                        return "hung", f"stream not done in {args.request_timeout:g} s", retries
                    if line == "data: [DONE]":
                        done = True
                        break
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "failed", f"error event in a 200 stream: {event['error']}", retries
                    if event.get("choices"):
                        text += event["choices"][0].get("delta", {}).get("content") or ""
                        chunks += 1
                    if close_after is not None and chunks >= close_after:
                        return "closed", text, retries  # leaving the block closes the stream
                if not done:
                    return "failed", f"stream ended without [DONE] after {chunks} chunks", retries
                return "ok", text, retries
        except httpx.TimeoutException as e:
            return "hung", f"{type(e).__name__} after {args.request_timeout:g} s", retries
        except (httpx.HTTPError, ValueError, KeyError) as e:
            return "failed", f"{type(e).__name__}: {e}", retries
    return "hung", f"503 retried {MAX_RETRIES}x", retries


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    streamed: int = 0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    examples: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    retries: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, outcome: Outcome, stream: bool, note: str) -> None:
        with self.lock:
            self.sent += 1
            self.streamed += stream
            self.counts[outcome.kind] += 1
            self.retries += outcome.retries
            if outcome.kind == "ok":
                self.latencies.append(outcome.seconds)
            if outcome.kind in ("wrong", "failed", "hung") and len(self.examples[outcome.kind]) < 3:
                self.examples[outcome.kind].append(f"{note}: {outcome.detail}")


def judged(url: str, i: int, refs: list[str], args: argparse.Namespace, stream: bool,
           close_after: int | None = None) -> Outcome:  # fmt: skip
    started = time.monotonic()
    kind, text, retries = chat(url, PROMPTS[i], args, stream, close_after)
    seconds = time.monotonic() - started
    if kind == "ok" and text != refs[i]:
        return Outcome("wrong", text, f"got {text!r}, reference {refs[i]!r}", seconds, retries)
    if kind == "closed" and not refs[i].startswith(text):
        return Outcome("wrong", text, f"closed early with {text!r}, not a prefix of "
                       f"{refs[i]!r}", seconds, retries)  # fmt: skip
    return Outcome(kind, text if kind in ("ok", "closed") else "",
                   text if kind in ("failed", "hung") else "", seconds, retries)  # fmt: skip


def client(n: int, url: str, refs: list[str], args: argparse.Namespace, end: float,
           stop: threading.Event, tally: Tally) -> None:  # fmt: skip
    rng = random.Random(n)
    impatient = n % 2 == 1  # every other client closes half its streams after a few chunks
    for k in range(1_000_000):  # bounded by count and by ``end``
        if stop.is_set() or time.monotonic() >= end:
            return
        i = rng.randrange(len(PROMPTS))
        stream = (k + n) % 2 == 0
        close_after = rng.randint(2, 6) if stream and impatient and rng.random() < 0.5 else None
        try:
            outcome = judged(url, i, refs, args, stream, close_after)
        except Exception as e:  # a client never dies silently
            outcome = Outcome("failed", detail=f"client error {type(e).__name__}: {e}")
        mode = "stream" if stream else "plain"
        tally.add(outcome, stream, f"client {n} prompt #{i} ({mode}, "
                  f"{time.strftime('%H:%M:%S')})")  # fmt: skip
        if outcome.kind != "ok":
            print(f"client {n}: {outcome.kind} prompt #{i} ({mode}) "
                  f"{outcome.detail[:200]}", file=sys.stderr)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# faults


class Chaos:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, secret: Path | None,
                 pp_size: int, stop: threading.Event) -> None:  # fmt: skip
        self.proc, self.url, self.secret, self.pp_size, self.stop = proc, url, secret, pp_size, stop
        self.stopped: set[int] = set()  # SIGSTOPped pids, for the way out
        self.injected: collections.Counter[str] = collections.Counter()
        self.log: list[str] = []
        self.notes: list[str] = []
        self.victim = 0
        self.admin, self.elastic = False, False
        if secret is not None:
            done = self.ctl("status", "--json")
            if done.returncode == 0:
                self.admin = True
                self.elastic = bool(json.loads(done.stdout)["coordinator"].get("elastic_enabled"))
            else:
                said = f"{done.stdout.strip()[:120]} {done.stderr.strip()[:120]}".strip()
                self.notes.append(f"admin API not reachable ({said}): no repartition, no drain")
        else:
            self.notes.append("no cluster secret: no repartition, no drain")
        if self.admin and not self.elastic:
            self.notes.append("elastic repartitioning is off: no repartition fault")

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = [str(BIN / "mlxppctl"), *args, "--url", self.url,
               "--cluster-secret-file", str(self.secret)]  # fmt: skip
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {timeout:g} s")

    def kinds(self) -> list[str]:
        return [k for k in FAULTS if (k != "repartition" or self.elastic)
                and (k != "drain" or self.admin)]  # fmt: skip

    def healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop.is_set():
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            self.stop.wait(1)
        return False

    def run(self, started: float, end: float, every: float) -> None:
        """Fault n at ``every * n`` seconds into the soak (a slow fault does not shift the
        rest), once the cluster is healthy; none that would start in the last second."""
        kinds = self.kinds()
        for n in range(1, int((end - started) / every) + 1):  # bounded by count and time
            at = started + n * every
            if self.stop.wait(max(0.0, at - time.monotonic())):
                return
            waited = time.monotonic()
            if not self.healthy(timeout=min(120.0, end - waited)):
                if time.monotonic() < end - 1:
                    self.record("skipped", "the cluster was not healthy in time")
                continue
            if time.monotonic() >= end - 1:
                return
            kind = kinds[(n - 1) % len(kinds)]
            try:
                getattr(self, kind)(time.monotonic() - waited)
            except Exception as e:  # reported, not fatal
                self.record(kind, f"the fault itself failed: {type(e).__name__}: {e}")

    def record(self, kind: str, what: str) -> None:
        self.injected[kind] += 1
        line = f"{time.strftime('%H:%M:%S')} {kind}: {what}"
        self.log.append(line)
        print(f"fault {line}", file=sys.stderr)

    def next_victim(self) -> tuple[int, int]:
        self.victim = (self.victim + 1) % self.pp_size  # stage 1, 2, ..., 0, 1, ...
        pid = stage_pid(self.proc.pid, self.victim)
        if pid is None:
            raise RuntimeError(f"no process of stage {self.victim} among the serve's children")
        return self.victim, pid

    def sigkill(self, waited: float) -> None:
        stage, pid = self.next_victim()
        os.kill(pid, signal.SIGKILL)
        self.record("sigkill", f"stage {stage} (pid {pid}), after {waited:.0f} s waiting for "
                    "health")  # fmt: skip

    def sigstop(self, waited: float) -> None:
        stage, pid = self.next_victim()
        pause = 2 * HEARTBEAT_TIMEOUT_S
        self.stopped.add(pid)
        os.kill(pid, signal.SIGSTOP)
        try:
            self.stop.wait(pause)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.stopped.discard(pid)
        self.record("sigstop", f"stage {stage} (pid {pid}) for {pause:g} s, then SIGCONT")

    def repartition(self, waited: float) -> None:
        status = json.loads(self.ctl("status", "--json").stdout)
        ranges = [tuple(int(x) for x in s["layers"].split("-")) for s in status["stages"]]
        j = self.injected["repartition"] % (len(ranges) - 1)  # the boundary to move
        (a, b), (c, d) = ranges[j], ranges[j + 1]
        shift = -1 if b > a else 1
        ranges[j], ranges[j + 1] = (a, b + shift), (c + shift, d)
        plan = ",".join(f"{lo}-{hi}" for lo, hi in ranges)
        started = time.monotonic()
        done = self.ctl("repartition", "--pp-layers", plan, "--wait", "--wait-timeout", "300",
                        timeout=330)  # fmt: skip
        last = (done.stdout.strip().splitlines() or [done.stderr.strip()])[-1][:160]
        self.record("repartition", f"--pp-layers {plan}: exit {done.returncode} in "
                    f"{time.monotonic() - started:.1f} s ({last})")  # fmt: skip

    def drain(self, waited: float) -> None:
        done = self.ctl("drain")
        try:
            self.stop.wait(3)
        finally:
            back = self.ctl("resume")
        self.record("drain", f"drain exit {done.returncode} ({done.stdout.strip()[:80]}), 3 s, "
                    f"resume exit {back.returncode} ({back.stdout.strip()[:60]})")  # fmt: skip

    def release(self) -> None:
        """SIGCONT every process this soak stopped, and any stopped descendant."""
        pids = set(self.stopped)
        if self.proc.poll() is None:
            pids |= {p for p in descendants(self.proc.pid) if (_stat(p) or ("",))[0] == "T"}
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped.clear()


# ---------------------------------------------------------------------------------------------
# memory


class Sampler:
    """(time, {role: (pid, rss KiB, fds)}) of the serve process and its descendants."""

    def __init__(self, root: int, every: float, stop: threading.Event) -> None:
        self.root, self.every, self.stop = root, every, stop
        self.samples: list[tuple[float, dict[str, tuple[int, int, int]]]] = []
        self.lock = threading.Lock()

    def sample(self) -> None:
        snap = {}
        for pid in [self.root, *descendants(self.root)]:
            if (u := usage(pid)) is not None:
                snap[role(pid, self.root)] = (pid, *u)
        with self.lock:
            self.samples.append((time.monotonic(), snap))

    def run(self, end: float) -> None:
        for _ in range(int((end - time.monotonic()) / self.every) + 2):  # bounded
            if self.stop.wait(self.every) or time.monotonic() >= end:
                return
            self.sample()


# ---------------------------------------------------------------------------------------------
# the serve log


def normalize(line: str) -> str:
    line = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", "", line.strip())
    line = re.sub(r"\b(?:req|chatcmpl|cmpl|seq)-[0-9a-zA-Z]+", "<id>", line)
    line = re.sub(r"\b[0-9a-f]{8,}\b", "<hex>", line)
    line = re.sub(r"\d+(?:\.\d+)?", "N", line)
    return line[:160]


def references(url: str, args: argparse.Namespace) -> tuple[list[str], list[str], float]:
    """The greedy answers, one request at a time: (texts, problems, mean seconds)."""
    texts, problems, seconds = [], [], []
    for i, prompt in enumerate(PROMPTS):
        started = time.monotonic()
        kind, text, _ = chat(url, prompt, args, stream=False)
        seconds.append(time.monotonic() - started)
        texts.append(text if kind == "ok" else "")
        if kind != "ok" or not text:
            problems.append(f"prompt #{i}: {kind} {text[:160]}")
    return texts, problems, statistics.mean(seconds)


def port_range(size: int = 30) -> str:
    """A block of free loopback ports away from the default 39600-39629, which other local
    clusters on this host (tests, benches) take theirs from."""
    rng = random.Random()
    for _ in range(50):  # bounded
        first = rng.randrange(41000, 48000 - size)
        try:
            for port in range(first, first + size):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return f"{first}-{first + size - 1}"
    raise RuntimeError("no block of free ports found")


def start_cluster(args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen[bytes],
                                                                   Path | None]:  # fmt: skip
    secret: Path | None = work / "cluster.secret"
    made = subprocess.run([str(BIN / "mlxppctl"), "secret", "new", str(secret)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    if made.returncode != 0:
        print(f"note: no cluster secret ({made.stderr.strip()[:160]})", file=sys.stderr)
        secret = None
    ready, log_path = work / "ready", work / "serve.log"
    cmd = [str(BIN / "mlxppd"), "serve", "--pp-size", str(args.pp_size), "--port", "0",
           "--host", "127.0.0.1", "--ready-file", str(ready),
           "--transport-port-range", port_range()]  # fmt: skip
    if secret is not None:
        cmd += ["--cluster-secret-file", str(secret), "--enable-elastic-pp"]
    if args.model:
        cmd += ["--model", args.model]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    return proc, secret


def wait_ready(proc: subprocess.Popen[bytes], work: Path, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while not (work / "ready").exists():
        if proc.poll() is not None:
            raise RuntimeError("serve exited before it was ready:\n"
                               + (work / "serve.log").read_text()[-3000:])  # fmt: skip
        if time.monotonic() > deadline:
            raise RuntimeError(f"serve not ready within {timeout:g} s")
        time.sleep(0.2)
    url = (work / "ready").read_text().strip()
    if urlsplit(url).hostname != "127.0.0.1":
        raise RuntimeError(f"serve listens on {url}, not 127.0.0.1")
    return url


def shutdown(proc: subprocess.Popen[bytes], chaos: Chaos | None) -> None:
    """SIGCONT what is stopped, SIGINT the serve process; SIGKILL it and its descendants when
    it does not exit in 60 s."""
    if chaos is not None:
        chaos.release()
    if proc.poll() is not None:
        return
    family = descendants(proc.pid)
    for pid in family:  # a stopped process could not exit
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        print("serve did not exit in 60 s: SIGKILL", file=sys.stderr)
        for pid in [proc.pid, *family]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)


# ---------------------------------------------------------------------------------------------
# the report


def pct(a: float, b: float) -> str:
    return f"{(b - a) / a * 100:+.1f}%" if a else "n/a"


def memory_rows(sampler: Sampler, warm_until: float, end: float) -> list[str]:
    with sampler.lock:
        under_load = [s for s in sampler.samples if s[0] <= end]
    after_warm = [s for s in under_load if s[0] >= warm_until] or under_load
    if not after_warm:
        return ["| (no samples) | | | | | | | |"]
    first, last = after_warm[0][1], after_warm[-1][1]
    peak: dict[str, int] = collections.defaultdict(int)
    pids: dict[str, list[int]] = collections.defaultdict(list)
    for _, snap in under_load:
        for name, (pid, rss, _fds) in snap.items():
            peak[name] = max(peak[name], rss)
            if pid not in pids[name]:
                pids[name].append(pid)
    rows = []
    for name in sorted(set(first) | set(last), key=lambda r: (r != "coordinator", r)):
        a, b = first.get(name), last.get(name)
        if a is None or b is None:
            rows.append(f"| {name} | {', '.join(map(str, pids[name]))} | only at the "
                        f"{'start' if b is None else 'end'} | | | | | |")  # fmt: skip
            continue
        procs = f"{a[0]}" if a[0] == b[0] else f"{a[0]} -> {b[0]} (restarted)"
        rows.append(f"| {name} | {procs} | {a[1] / 1024:.0f} | {b[1] / 1024:.0f} | "
                    f"{pct(a[1], b[1])} | {peak[name] / 1024:.0f} | {a[2]} -> {b[2]} | "
                    f"{pct(a[2], b[2])} |")  # fmt: skip
    return rows


def report(args: argparse.Namespace, seconds: float, tally: Tally, chaos: Chaos,
           sampler: Sampler, warm_until: float, load_end: float, log_text: str,
           base_s: float, refs_after: tuple[bool, str]) -> None:  # fmt: skip
    c = tally.counts

    def examples(kind: str) -> str:
        return "; ".join(e.replace("|", "\\|").replace("\n", "\\n")[:300]
                         for e in tally.examples[kind])  # fmt: skip

    outcomes = collections.Counter(m.group(1) for m in FAILOVER_LINE.finditer(log_text))
    recover_s = [float(m.group(2)) for m in FAILOVER_LINE.finditer(log_text)]
    lines = log_text.splitlines()
    errors = [line for line in lines if re.search(r"\bERROR\b", line)]
    restarts = re.findall(r"^restarted stage \d+/\d+", log_text, re.M)
    exits = re.findall(r"stage \d+ \(pid \d+\) exited with status (-?\d+)", log_text)
    tracebacks = []  # the exception line that ends each traceback
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            tail = next((x for x in lines[i + 1 : i + 200] if x and not x[0].isspace()), "?")
            tracebacks.append(tail.replace("|", "/").replace("`", "'"))
    lat = sorted(tally.latencies)
    p50 = f"{statistics.median(lat):.1f}" if lat else "n/a"
    print(f"\nchaos soak: mlxppd serve --pp-size {args.pp_size}, {seconds:.0f} s of load, "
          f"{args.clients} clients, max_tokens {args.max_tokens}, a fault every "
          f"{args.fault_every:g} s\n")  # fmt: skip
    print("| measure | value |")
    print("|---|---|")
    rows = [
        ("requests sent", f"{tally.sent} ({tally.streamed} streamed)"),
        ("completed exact", str(c["ok"])),
        ("wrong (text differs)", f"{c['wrong']} {examples('wrong')}".strip()),
        (
            "failed (HTTP error, error in a 200 stream)",
            f"{c['failed']} {examples('failed')}".strip(),
        ),  # fmt: skip
        (
            f"hung (no answer in {args.request_timeout:g} s)",
            f"{c['hung']} {examples('hung')}".strip(),
        ),  # fmt: skip
        (
            "closed early (impatient clients; text so far a prefix of the reference)",
            str(c["closed"]),
        ),  # fmt: skip
        ("503 + Retry-After answers retried", str(tally.retries)),
        (
            "latency of an exact answer under chaos, s: p50 / max",
            f"{p50} / {lat[-1]:.1f}" if lat else "n/a",
        ),  # fmt: skip
        (
            "baseline: latency of a reference, undisturbed, one at a time, s (mean)",
            f"{base_s:.1f}",
        ),  # fmt: skip
        ("faults injected", ", ".join(f"{k} {v}" for k, v in chaos.injected.items()) or "none"),
        (
            "recoveries in the serve log (`failover: X after N s`)",
            (
                ", ".join(f"{k} {v}" for k, v in outcomes.items())
                + (f"; max {max(recover_s):.1f} s" if recover_s else "")
            )
            or "none",
        ),  # fmt: skip
        ("final references exact", ("yes" if refs_after[0] else "NO ") + refs_after[1]),
        (
            "stage restarts by the local cluster's supervisor (serve log)",
            f"{len(restarts)}; exits: "
            + (
                ", ".join(f"status {k} x{v}" for k, v in collections.Counter(exits).items())
                or "none"
            ),
        ),
        (
            "tracebacks in the serve log (last line, most common first)",
            f"{len(tracebacks)} "
            + "; ".join(
                f"{n}x `{t[:120]}`" for t, n in collections.Counter(tracebacks).most_common(3)
            ),
        ),
        ("ERROR lines in the serve log", str(len(errors))),
    ]
    for name, value in rows:
        print(f"| {name} | {value} |")
    for note in chaos.notes:
        print(f"\nnote: {note}")
    if chaos.log:
        print("\nfaults:\n" + "\n".join(f"- {line}" for line in chaos.log))
    print("\nmemory and fds under load, after warm-up vs end (RSS MiB)\n")
    print("| process | pid | RSS start | RSS end | growth | RSS peak | fds start -> end | "
          "fds growth |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in memory_rows(sampler, warm_until, load_end):
        print(row)
    if errors:
        print("\nthe most common ERROR lines (ids and numbers replaced)\n")
        print("| count | line |")
        print("|---:|---|")
        for line, n in collections.Counter(map(normalize, errors)).most_common(5):
            print(f"| {n} | `{line.replace('|', '/').replace('`', chr(39))}` |")


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--pp-size", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, help="soak duration in seconds (a smoke run)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--fault-every", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--sample-every", type=float, default=5.0)
    args = parser.parse_args(argv)
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    if duration <= 0 or args.clients < 1 or args.fault_every <= 0 or args.pp_size < 2:
        parser.error("--seconds/--minutes, --clients and --fault-every must be > 0, "
                     "--pp-size >= 2")  # fmt: skip

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="mlxpp-soak-"))
    print(f"soak: writing to {work}", file=sys.stderr)
    stop = threading.Event()
    chaos: Chaos | None = None
    proc, secret = start_cluster(args, work)
    verdict, keep_log = "interrupted", True
    try:
        url = wait_ready(proc, work)
        print(f"soak: cluster ready on {url}; references", file=sys.stderr)
        refs, problems, base_s = references(url, args)
        if problems:
            verdict = f"the undisturbed references failed: {'; '.join(problems)}"
            raise RuntimeError(verdict)
        chaos = Chaos(proc, url, secret, args.pp_size, stop)
        for note in chaos.notes:
            print(f"note: {note}", file=sys.stderr)
        sampler = Sampler(proc.pid, args.sample_every, stop)
        sampler.sample()
        tally = Tally()
        started = time.monotonic()
        end = started + duration
        warm_until = started + min(60.0, duration / 4)
        print(f"soak: {duration:.0f} s, {args.clients} clients, faults "
              f"{chaos.kinds()} every {args.fault_every:g} s", file=sys.stderr)  # fmt: skip
        threads = [threading.Thread(target=client, args=(n, url, refs, args, end, stop, tally),
                                    daemon=True) for n in range(args.clients)]  # fmt: skip
        threads.append(threading.Thread(target=chaos.run, args=(started, end, args.fault_every),
                                        daemon=True))  # fmt: skip
        threads.append(threading.Thread(target=sampler.run, args=(end,), daemon=True))
        for t in threads:
            t.start()
        for _ in range(int(duration) + 10):  # bounded: one check a second
            if time.monotonic() >= end or proc.poll() is not None:
                break
            time.sleep(1)
        if proc.poll() is not None:
            verdict = f"the serve process exited with status {proc.returncode} mid-soak"
            raise RuntimeError(verdict)
        sampler.sample()  # the end, still under load (requests in flight)
        load_end = time.monotonic()
        print("soak: load over; waiting for the last requests", file=sys.stderr)
        join_by = time.monotonic() + args.request_timeout + 20
        for t in threads:
            t.join(max(0.0, join_by - time.monotonic()))
        stop.set()
        chaos.release()
        stop.clear()  # the health wait below listens to it
        if not chaos.healthy(timeout=120):
            print("soak: the cluster is not healthy 120 s after the load", file=sys.stderr)
        after, problems, _ = references(url, args)
        stop.set()
        pairs = enumerate(zip(after, refs, strict=True))
        diffs = [f"#{i}: {a!r} != {r!r}" for i, (a, r) in pairs if a != r]
        refs_ok = not diffs and not problems
        refs_note = "" if refs_ok else "; ".join(problems + diffs)[:600]
        log_text = (work / "serve.log").read_text(errors="replace")
        keep_log = bool(re.search(r"\bERROR\b|^Traceback", log_text, re.M))
        report(args, load_end - started, tally, chaos, sampler, warm_until, load_end, log_text,
               base_s, (refs_ok, refs_note))  # fmt: skip
        c = tally.counts
        why = [f"{c[k]} {k}" for k in ("wrong", "failed", "hung") if c[k]]
        if not refs_ok:
            why.append("final references differ")
        verdict = "ok" if not why else "FAIL: " + ", ".join(why)
        print(f"\nverdict: {verdict}")
        return 0 if not why else 1
    except KeyboardInterrupt as e:
        verdict = f"interrupted ({e or 'Ctrl-C'})"
        print(f"\nverdict: FAIL: {verdict}")
        return 130
    except Exception as e:
        print(f"\nverdict: FAIL: {verdict if verdict != 'interrupted' else e}")
        raise
    finally:
        stop.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        shutdown(proc, chaos)
        if verdict == "ok" and not keep_log:  # a log with errors stays for reading
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"soak: the serve log is in {work / 'serve.log'}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
