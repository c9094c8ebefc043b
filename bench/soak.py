"""A bounded chaos soak of a live local cluster: faults under load, nothing lost, memory flat.

    .venv/bin/python bench/soak.py [--minutes 20 | --seconds S] [--clients 4]
        [--fault-every 60] [--fault-jitter 1] [--seed 1] [--pp-size 3] [--model DIR]

Starts ``mlxppd serve --pp-size N --port 0`` (its supervisor restarts a dead stage process on
its port, the coordinator's failover reconnects and replays) with a fresh cluster secret and
``--enable-elastic-pp`` on a block of free transport ports of its own, everything it writes in
one temp dir. The stage processes inherit the serve process's stdout and stderr, so its log
(``serve.log``, kept when it holds an ERROR or a traceback) is every process's log.

First the reference answers, one request at a time and undisturbed: the greedy answer of each
of a fixed set of prompts, seeded sampled answers (temperature > 0 and a ``seed``, each drawn
twice: a seed must reproduce its sample), a ``json_object`` and a ``json_schema`` answer (they
must parse) and the slow reader's long greedy answer (4 choices of 128 tokens). Then for the
soak's duration C client threads loop over greedy and seeded requests (every other one
streamed; the odd clients close some streams after a few chunks, "closed" once the text so far
is a prefix of the reference), and every answer must equal its reference exactly. Meanwhile
faults, one every ``--fault-every`` to ``--fault-every * (1 + --fault-jitter)`` seconds, in an
order drawn from ``--seed``:

- on the cluster: SIGKILL a stage process; SIGSTOP a stage for twice the heartbeat timeout,
  then SIGCONT; a repartition (``mlxppctl repartition --wait``, one layer across a boundary,
  then back: between faults the plan is the first one); a drain (``mlxppctl drain``, 3 s,
  ``mlxppctl resume``). After each, a probe request: the recovery time is from the fault's
  start to the probe's exact answer. These wait for ``/health``; the admin two are skipped
  when the signed admin API is off;
- from clients: an early close (three streams closed after 0, 1 and 3 chunks and a bystander
  stream, at once); a slow reader (a 4 KiB receive buffer, the first KiB, nothing for
  ``--slow-stall`` s, then 512 bytes every 0.1 s: the server may cut it, "slow cut", or finish
  it exactly); a grammar request (``json_object`` plain and ``json_schema`` streamed, at once).

A sampler reads every process's RSS and open fds (``/proc``) every few seconds. At the end the
references again and the report: a per-minute table (by send time: sent, ok, closed, slow cut,
4xx, 5xx, err, wrong, hung, 503s retried, faults), the faults and their recovery times, the
failovers the log reports, RSS and fds per process at the start, after warm-up and at the end,
the log's tracebacks (count, and the first lines of each distinct one) and ERROR lines, and one
PASS/FAIL line per criterion:

- lost: every request that should succeed did (no 4xx, 5xx, err or hung);
- wrong: every answer equals its reference (a grammar answer also parses as JSON);
- final references exact; no traceback in the log;
- RSS growth under ``--rss-growth`` % per process, from after warm-up to the end;
- fds flat per process (at most ``--fds-slack`` more at the end than after warm-up);
- faults: each one applied, each cluster fault recovered (its probe answered exactly);
- clean exit: after the final references the serve process exits on SIGINT within 60 s with
  status 0 or 130, and its stage processes with it.

Exit status 0 only when every criterion passes. All traffic goes to 127.0.0.1. Ctrl-C, SIGTERM
or an error stops everything it started.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
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
from collections.abc import Callable
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
#: seeded sampled requests: (prompt index, seed) at SAMPLE_TEMPERATURE
SEEDED = [(1, 11), (3, 23), (6, 37)]
SAMPLE_TEMPERATURE = 0.8
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
#: grammar requests: name -> (prompt, response_format); both close in a few dozen tokens
GRAMMAR = {
    "json_object": ("Describe a person as JSON with a name and an age.", {"type": "json_object"}),
    "json_schema": (
        "Describe a person as JSON.",
        {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    ),
}
GRAMMAR_MAX_TOKENS = 96
#: the slow reader's choices: n times the bytes (enough to fill the buffers between it and the
#: server's stream writer) for about the decode time of one
SLOW_CHOICES = 4
SEP = "\x1e"  # between the choices' texts of an n > 1 answer
#: the local cluster's failover settings are the defaults (docs/failover.md)
HEARTBEAT_TIMEOUT_S = 5.0
CLUSTER_FAULTS = ["sigkill", "sigstop", "repartition", "drain"]
CLIENT_FAULTS = ["early-close", "slow-reader", "grammar"]
FAILOVER_LINE = re.compile(r"failover: (reconnected|standby|survivors|failed) after ([\d.]+) s")
MAX_RETRIES = 100  # 503 + Retry-After answers one request may retry, within its deadline
#: outcomes of a request that should have succeeded and did not
LOST = ("4xx", "5xx", "err", "hung")
#: the per-minute table's outcome columns
COLUMNS = ("ok", "closed", "cut", *LOST[:3], "wrong", "hung")
WINDOW = 3  # samples averaged (median) after warm-up and at the end


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


@dataclass(frozen=True)
class Job:
    """A request whose answer the soak knows: its chat body, less ``stream``."""

    name: str
    body: dict[str, object]
    json_answer: bool = False  # a grammar request: the answer must parse as JSON too

    @property
    def choices(self) -> int:
        n = self.body.get("n", 1)
        return n if isinstance(n, int) else 1


def mlx_allocator(url: str) -> list[tuple[str, tuple[float, float]]]:
    """(stage, (active bytes, cache bytes)) from the coordinator's /metrics; [] if unread."""
    try:
        with httpx.Client(timeout=10) as http:
            text = http.get(f"{url}/metrics").text
    except httpx.HTTPError:
        return []
    found: dict[str, list[float]] = {}
    pattern = r'^mlxpp_stage_mlx_(active|cache)_bytes\{stage="(\d+)"\} (\S+)$'
    for kind, stage, value in re.findall(pattern, text, re.M):
        found.setdefault(stage, [0.0, 0.0])[kind == "cache"] = float(value)
    return [(s, (v[0], v[1])) for s, v in sorted(found.items())]


def job_table(args: argparse.Namespace) -> dict[str, Job]:
    def body(prompt: str, max_tokens: int, **more: object) -> dict[str, object]:
        return {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **more,
        }

    jobs = [Job(f"greedy#{i}", body(p, args.max_tokens)) for i, p in enumerate(PROMPTS)]
    jobs += [
        Job(
            f"seeded#{i}",
            body(PROMPTS[i], args.max_tokens, seed=seed, temperature=SAMPLE_TEMPERATURE),
        )
        for i, seed in SEEDED
    ]
    jobs += [
        Job(name, body(prompt, GRAMMAR_MAX_TOKENS, response_format=fmt), json_answer=True)
        for name, (prompt, fmt) in GRAMMAR.items()
    ]
    jobs.append(Job("slow", body(PROMPTS[0], args.slow_max_tokens, n=SLOW_CHOICES)))
    return {job.name: job for job in jobs}


@dataclass
class Outcome:
    #: ok, closed (by this client), cut (the server ended the stream early), 4xx, 5xx, err
    #: (a connection error, an error event in a 200 stream), hung, wrong
    kind: str
    text: str = ""
    detail: str = ""
    retries: int = 0
    seconds: float = 0.0


def status_kind(code: int) -> str:
    return "4xx" if 400 <= code < 500 else "5xx" if code >= 500 else "err"


def sse_event(line: str) -> tuple[str, str, int]:
    """("done" | "error" | "text" | "", value, choice index) of one SSE line."""
    if line == "data: [DONE]":
        return "done", "", 0
    if not line.startswith("data: {"):
        return "", "", 0
    event = json.loads(line[6:])
    if "error" in event:
        return "error", str(event["error"])[:300], 0
    if event.get("choices"):
        choice = event["choices"][0]
        return "text", choice.get("delta", {}).get("content") or "", int(choice.get("index", 0))
    return "", "", 0


def joined(texts: dict[int, str], n: int) -> str:
    """The answer of an ``n``-choice request: its choices' texts in index order, SEP between."""
    return SEP.join(texts.get(i, "") for i in range(n))


def is_prefix(got: str, ref: str) -> bool:
    """Every choice's text so far starts its reference."""
    parts, refs = got.split(SEP), ref.split(SEP)
    return len(parts) == len(refs) and all(
        r.startswith(g) for g, r in zip(parts, refs, strict=True)
    )


def chat(
    url: str, job: Job, args: argparse.Namespace, stream: bool, close_after: int | None = None
) -> Outcome:
    """One chat request, retrying 503 + Retry-After within ``--request-timeout``; a stream is
    closed by this client after ``close_after`` chunks (0: right after the headers)."""
    body = {**job.body, "stream": stream}
    n = job.choices
    deadline = time.monotonic() + args.request_timeout
    retries = 0
    for _ in range(MAX_RETRIES + 1):
        left = deadline - time.monotonic()
        if left <= 0:
            return Outcome(
                "hung", detail=f"no answer in {args.request_timeout:g} s", retries=retries
            )
        timeout = httpx.Timeout(left, connect=min(10.0, left))
        try:
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body, timeout=timeout
            ) as r:
                if r.status_code == 503 and "retry-after" in r.headers:
                    retries += 1
                    pause = min(float(r.headers["retry-after"]), 5.0)
                    time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
                    continue
                if r.status_code != 200:
                    said = r.read().decode(errors="replace")[:200]
                    return Outcome(
                        status_kind(r.status_code),
                        detail=f"HTTP {r.status_code}: {said}",
                        retries=retries,
                    )
                if not stream:
                    choices = json.loads(r.read())["choices"]
                    got = {int(c["index"]): c["message"]["content"] or "" for c in choices}
                    return Outcome("ok", joined(got, n), retries=retries)
                if close_after == 0:
                    return Outcome("closed", joined({}, n), retries=retries)
                texts: dict[int, str] = collections.defaultdict(str)
                chunks = 0
                for line in r.iter_lines():
                    if time.monotonic() > deadline:
                        why = f"stream not done in {args.request_timeout:g} s"
                        return Outcome("hung", joined(texts, n), why, retries)
                    what, value, index = sse_event(line)
                    if what == "done":
                        return Outcome("ok", joined(texts, n), retries=retries)
                    if what == "error":
                        why = f"error event in a 200 stream: {value}"
                        return Outcome("err", joined(texts, n), why, retries)
                    if what == "text":
                        texts[index] += value
                        chunks += 1
                    if close_after is not None and chunks >= close_after:
                        # leaving the block closes the stream
                        return Outcome("closed", joined(texts, n), retries=retries)
                why = f"stream ended without [DONE] after {chunks} chunks"
                return Outcome("cut", joined(texts, n), why, retries)
        except httpx.TimeoutException as e:
            return Outcome(
                "hung",
                detail=f"{type(e).__name__} after {args.request_timeout:g} s",
                retries=retries,
            )
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            return Outcome("err", detail=f"{type(e).__name__}: {e}", retries=retries)
    return Outcome("hung", detail=f"503 retried {MAX_RETRIES}x", retries=retries)


def sse_text(data: bytes, n: int) -> tuple[str, bool, str]:
    """(answer, [DONE] seen, error event) of a stream's bytes; a last partial line is dropped."""
    texts: dict[int, str] = collections.defaultdict(str)
    for raw in data.split(b"\n")[:-1]:
        what, value, index = sse_event(raw.decode(errors="replace").rstrip("\r"))
        if what == "done":
            return joined(texts, n), True, ""
        if what == "error":
            return joined(texts, n), False, value
        if what == "text":
            texts[index] += value
    return joined(texts, n), False, ""


def slow_read(url: str, job: Job, args: argparse.Namespace) -> Outcome:
    """A streamed request read the way a stalled client reads: a 4 KiB receive buffer, the first
    KiB, then nothing for ``--slow-stall`` s, then 512 bytes every 0.1 s. "cut" when the server
    ends it early (it may, a client this slow holds its buffers)."""
    limit = args.request_timeout + args.slow_stall
    deadline = time.monotonic() + limit
    transport = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    retries, body = 0, {**job.body, "stream": True}
    try:
        with httpx.Client(transport=transport, timeout=httpx.Timeout(limit, connect=10)) as c:
            for _ in range(MAX_RETRIES + 1):
                with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    if r.status_code == 503 and "retry-after" in r.headers:
                        retries += 1
                        time.sleep(min(float(r.headers["retry-after"]), 5.0))
                        continue
                    if r.status_code != 200:
                        return Outcome(
                            status_kind(r.status_code),
                            detail=f"HTTP {r.status_code}",
                            retries=retries,
                        )
                    got, stalled, cut_by = bytearray(), False, ""
                    try:
                        for piece in r.iter_raw(512):
                            got += piece
                            if time.monotonic() > deadline:
                                return Outcome("hung", detail=f"not done in {limit:g} s")
                            if not stalled and len(got) >= 1024:
                                stalled = True
                                time.sleep(args.slow_stall)
                            else:
                                time.sleep(0.1)
                    except httpx.TimeoutException:
                        raise
                    except httpx.HTTPError as e:
                        cut_by = f"{type(e).__name__}: {e}"
                    text, done, error = sse_text(bytes(got), job.choices)
                    if error or not done:
                        why = f"error event: {error}" if error else cut_by or "no [DONE]"
                        return Outcome("cut", text, f"after {len(got)} bytes: {why}", retries)
                    return Outcome("ok", text, retries=retries)
    except httpx.TimeoutException as e:
        return Outcome("hung", detail=f"{type(e).__name__}", retries=retries)
    except (httpx.HTTPError, ValueError) as e:
        return Outcome("err", detail=f"{type(e).__name__}: {e}", retries=retries)
    return Outcome("hung", detail=f"503 retried {MAX_RETRIES}x", retries=retries)


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def difference(got: str, ref: str) -> str:
    """Where an answer first differs from its reference, with some text either side."""
    i = next(
        (k for k, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
        min(len(got), len(ref)),
    )
    choice = f" (choice {ref[:i].count(SEP)})" if SEP in ref else ""
    lo = max(0, i - 40)
    return (
        f"differs at char {i} of {len(ref)}{choice}: got ...{got[lo : i + 60]!r}, "
        f"reference ...{ref[lo : i + 60]!r}"
    )


def judge(job: Job, ref: str, got: Outcome, slow: bool) -> Outcome:
    """``got`` against the reference: an "ok" that differs is "wrong", so is a closed or cut
    stream whose text is no prefix of it; a cut stream is "err" but for the slow reader."""
    if got.kind == "ok" and job.json_answer and not parses(got.text):
        got.kind, got.detail = "wrong", f"not JSON: {got.text!r}"
    elif got.kind == "ok" and got.text != ref:
        got.kind, got.detail = "wrong", difference(got.text, ref)
    elif got.kind in ("closed", "cut") and not is_prefix(got.text, ref):
        got.detail = f"{got.kind} with {got.text!r}, not a prefix of {ref!r}"
        got.kind = "wrong"
    elif got.kind == "cut" and not slow:
        got.kind = "err"
    return got


@dataclass(frozen=True)
class Record:
    at: float  # seconds into the soak when it was sent
    seconds: float
    job: str
    mode: str  # plain, stream, close@N, slow
    kind: str
    retries: int


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    records: list[Record] = field(default_factory=list)
    examples: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    latencies: list[float] = field(default_factory=list)

    def add(self, record: Record, detail: str, note: str) -> None:
        with self.lock:
            self.records.append(record)
            if record.kind == "ok" and record.mode in ("plain", "stream"):
                self.latencies.append(record.seconds)
            if record.kind not in ("ok", "closed") and len(self.examples[record.kind]) < 3:
                self.examples[record.kind].append(f"{note}: {detail}")

    def snapshot(self) -> list[Record]:
        with self.lock:
            return list(self.records)


class Load:
    """Sends one judged request and tallies it; the clients, the faults and the probes use it."""

    def __init__(
        self,
        url: str,
        jobs: dict[str, Job],
        refs: dict[str, str],
        args: argparse.Namespace,
        tally: Tally,
        t0: float,
    ) -> None:
        self.url, self.jobs, self.refs, self.args, self.tally = url, jobs, refs, args, tally
        self.t0 = t0

    def one(
        self,
        name: str,
        stream: bool,
        close_after: int | None = None,
        who: str = "",
        slow: bool = False,
    ) -> Outcome:
        job, started = self.jobs[name], time.monotonic()
        try:
            got = (
                slow_read(self.url, job, self.args)
                if slow
                else chat(self.url, job, self.args, stream, close_after)
            )
        except Exception as e:  # a client never dies silently
            got = Outcome("err", detail=f"soak client error {type(e).__name__}: {e}")
        got.seconds = time.monotonic() - started
        outcome = judge(job, self.refs[name], got, slow)
        mode = (
            "slow"
            if slow
            else f"close@{close_after}"
            if close_after is not None
            else "stream"
            if stream
            else "plain"
        )
        sent = time.strftime("%H:%M:%S", time.localtime(time.time() - outcome.seconds))
        note = f"{who} {name} ({mode}, sent {sent})"
        self.tally.add(
            Record(started - self.t0, outcome.seconds, name, mode, outcome.kind, outcome.retries),
            outcome.detail,
            note,
        )
        if outcome.kind not in ("ok", "closed"):
            print(f"{note}: {outcome.kind} {outcome.detail[:240]}", file=sys.stderr)
        return outcome


def client(n: int, load: Load, end: float, stop: threading.Event) -> None:
    rng = random.Random(load.args.seed * 1000 + n)
    impatient = n % 2 == 1  # the odd clients close some of their streams after a few chunks
    greedy = [name for name in load.jobs if name.startswith("greedy#")]
    seeded = [name for name in load.jobs if name.startswith("seeded#")]
    for k in range(1_000_000):  # bounded by count and by ``end``
        if stop.is_set() or time.monotonic() >= end:
            return
        name = rng.choice(seeded if k % 4 == 3 else greedy)
        stream = (k + n) % 2 == 0
        close_after = rng.randint(1, 6) if stream and impatient and rng.random() < 0.3 else None
        load.one(name, stream, close_after, who=f"client {n}")


# ---------------------------------------------------------------------------------------------
# faults


def fault_schedule(
    kinds: list[str], duration: float, every: float, jitter: float, seed: int
) -> list[tuple[float, str]]:
    """(seconds into the soak, kind) of every fault: gaps drawn from [every, every * (1 +
    jitter)], the kinds in rounds that hold each once in a drawn order, cluster and client
    faults alternating (a short run sees both); none in the soak's last 5 s."""
    rng = random.Random(seed)
    server = [k for k in kinds if k in CLUSTER_FAULTS]
    clients = [k for k in kinds if k in CLIENT_FAULTS]
    out: list[tuple[float, str]] = []
    order: list[str] = []
    at = 0.0
    for _ in range(100_000):  # bounded
        at += every * (1 + jitter * rng.random())
        if at > duration - 5:
            break
        if not order:
            pairs = itertools.zip_longest(
                rng.sample(server, len(server)), rng.sample(clients, len(clients))
            )
            order = [k for pair in pairs for k in pair if k]
        out.append((at, order.pop(0)))
    return out


@dataclass(frozen=True)
class Recovery:
    kind: str
    at: float  # seconds into the soak the fault began
    action_s: float  # the fault's own action (a stop, a repartition, a drain)
    recovered_s: float | None  # fault start to the probe's exact answer; None: it was not
    detail: str


class Chaos:
    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        load: Load,
        secret: Path | None,
        pp_size: int,
        stop: threading.Event,
    ) -> None:
        self.proc, self.load, self.secret, self.pp_size = proc, load, secret, pp_size
        self.url, self.stop = load.url, stop
        self.stopped: set[int] = set()  # SIGSTOPped pids, for the way out
        self.injected: collections.Counter[str] = collections.Counter()
        self.failed: list[str] = []  # faults whose own action failed
        self.recoveries: list[Recovery] = []
        self.events: list[tuple[float, str]] = []  # (seconds into the soak, kind) injected
        self.not_run = 0  # faults skipped: the cluster was not healthy, or the load was over
        self.side: list[threading.Thread] = []  # the client faults' threads
        self.log: list[str] = []
        self.notes: list[str] = []
        self.lock = threading.Lock()
        self.victim, self.moves = 0, 0
        self.admin, self.elastic = False, False
        self.broken = ""  # why the admin API did not answer although a secret was made
        if secret is not None:
            done = self.ctl("status", "--json")
            if done.returncode == 0:
                self.admin = True
                self.elastic = bool(json.loads(done.stdout)["coordinator"].get("elastic_enabled"))
            else:
                said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()
                print(f"soak: mlxppctl status failed:\n{done.stderr.strip()}", file=sys.stderr)
                self.broken = f"mlxppctl status exit {done.returncode}: {said[-1][:200]}"
                self.notes.append(f"admin API not usable ({self.broken}): no repartition, no drain")
        else:
            self.notes.append("no cluster secret: no repartition, no drain")
        if self.admin and not self.elastic:
            self.notes.append("elastic repartitioning is off: no repartition fault")

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = [
            str(BIN / "mlxppctl"),
            *args,
            "--url",
            self.url,
            "--cluster-secret-file",
            str(self.secret),
        ]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {timeout:g} s")

    def kinds(self) -> list[str]:
        return [
            k
            for k in CLUSTER_FAULTS + CLIENT_FAULTS
            if (k != "repartition" or self.elastic) and (k != "drain" or self.admin)
        ]

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

    def run(self, schedule: list[tuple[float, str]], end: float) -> None:
        """Each fault at its time (a slow one does not shift the rest). The client faults on a
        thread of their own, so that they also land during a cluster fault (a repartition can
        take minutes); a cluster fault once ``/health`` answers 200, then a probe for its
        recovery time."""
        clients = [(at, kind) for at, kind in schedule if kind in CLIENT_FAULTS]
        side = threading.Thread(target=self.run_in_turn, args=(clients, end), daemon=True)
        side.start()
        self.run_in_turn([(at, kind) for at, kind in schedule if kind not in CLIENT_FAULTS], end)
        side.join(max(0.0, end - time.monotonic()) + 5)

    def run_in_turn(self, schedule: list[tuple[float, str]], end: float) -> None:
        for at, kind in schedule:
            if self.stop.wait(max(0.0, self.load.t0 + at - time.monotonic())):
                return
            if time.monotonic() >= end - 1:  # an earlier fault ran late
                self.record(kind, f"not run: due at +{at:.0f}s, the load was over", None)
                continue
            if kind in CLIENT_FAULTS:
                self.spawn(kind)
                continue
            if not self.healthy(timeout=min(120.0, end - time.monotonic())):
                if time.monotonic() < end - 1:
                    self.record(kind, "skipped: the cluster was not healthy in time", None)
                continue
            began = time.monotonic()
            try:
                what, applied = getattr(self, kind)()
            except Exception as e:  # reported, not fatal
                what, applied = f"the fault itself failed: {type(e).__name__}: {e}", False
            action_s = time.monotonic() - began
            if not applied:
                self.failed.append(f"{kind}: {what}")
            probe = self.load.one(
                f"greedy#{self.injected[kind] % len(PROMPTS)}", False, who=f"probe after {kind}"
            )
            recovered = time.monotonic() - began if probe.kind == "ok" else None
            self.recoveries.append(
                Recovery(kind, began - self.load.t0, action_s, recovered, probe.detail[:200])
            )
            self.record(
                kind,
                f"{what}; probe {probe.kind}"
                + (
                    f", recovered {recovered:.1f} s after the fault began"
                    if recovered is not None
                    else ""
                ),
                began,
            )

    def record(self, kind: str, what: str, began: float | None) -> None:
        """A fault's line; ``began`` None: it was not injected."""
        with self.lock:
            if began is None:
                self.not_run += 1
            else:
                self.injected[kind] += 1
                self.events.append((began - self.load.t0, kind))
            t = began or time.monotonic()
            wall = time.strftime("%H:%M:%S", time.localtime(time.time() - time.monotonic() + t))
            line = f"{wall} +{t - self.load.t0:.0f}s {kind}: {what}"
            self.log.append(line)
        print(f"fault {line}", file=sys.stderr)

    def next_victim(self) -> tuple[int, int]:
        self.victim = (self.victim + 1) % self.pp_size  # stage 1, 2, ..., 0, 1, ...
        pid = stage_pid(self.proc.pid, self.victim)
        if pid is None:
            raise RuntimeError(f"no process of stage {self.victim} among the serve's children")
        return self.victim, pid

    def sigkill(self) -> tuple[str, bool]:
        stage, pid = self.next_victim()
        os.kill(pid, signal.SIGKILL)
        return f"stage {stage} (pid {pid})", True

    def sigstop(self) -> tuple[str, bool]:
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
        return f"stage {stage} (pid {pid}) for {pause:g} s, then SIGCONT", True

    def repartition(self) -> tuple[str, bool]:
        """One layer across a boundary, then back: between faults the plan is always the one
        the soak started with, so the memory compared at the end is that of the same plan."""
        status = json.loads(self.ctl("status", "--json").stdout)
        layers = [s["layers"] for s in status["stages"]]
        if None in layers:
            raise RuntimeError(f"a stage's layers are unknown: {layers}")
        ranges = [(int(lo), int(hi)) for lo, hi in (text.split("-") for text in layers)]
        moved = list(ranges)
        j = self.moves % (len(ranges) - 1)  # the boundary to move, in turn
        self.moves += 1
        (a, b), (c, d) = ranges[j], ranges[j + 1]
        shift = -1 if b > a else 1
        moved[j], moved[j + 1] = (a, b + shift), (c + shift, d)
        there, applied = self.move(moved)
        if not applied:
            return there, False
        back, applied = self.move(ranges)
        return f"{there}; back {back}", applied

    def move(self, ranges: list[tuple[int, int]]) -> tuple[str, bool]:
        plan = ",".join(f"{lo}-{hi}" for lo, hi in ranges)
        started = time.monotonic()
        done = self.ctl(
            "repartition", "--pp-layers", plan, "--wait", "--wait-timeout", "300", timeout=330
        )
        last = (done.stdout.strip().splitlines() or [done.stderr.strip()])[-1][:160]
        took = time.monotonic() - started
        return f"--pp-layers {plan}: exit {done.returncode} in {took:.1f} s ({last})", (
            done.returncode == 0
        )

    def drain(self) -> tuple[str, bool]:
        done = self.ctl("drain")
        try:
            self.stop.wait(3)
        finally:
            back = self.ctl("resume")
        return (
            f"drain exit {done.returncode} ({done.stdout.strip()[:80]}), 3 s, resume exit "
            f"{back.returncode} ({back.stdout.strip()[:60]})",
            done.returncode == 0 == back.returncode,
        )

    def spawn(self, kind: str) -> None:
        """A client fault's requests, at once, in threads of their own; its line when done."""
        rng = random.Random(self.load.args.seed + len(self.side))
        greedy = rng.sample(range(len(PROMPTS)), 4)
        calls: list[Callable[[], Outcome]]
        if kind == "early-close":
            calls = [
                functools.partial(self.load.one, f"greedy#{i}", True, c, who=kind)
                for i, c in zip(greedy, (0, 1, 3), strict=False)
            ]
            calls.append(lambda: self.load.one(f"greedy#{greedy[3]}", True, who="bystander"))
            what = "3 streams closed after 0, 1 and 3 chunks and a bystander stream"
        elif kind == "slow-reader":
            calls = [lambda: self.load.one("slow", True, who=kind, slow=True)]
            what = f"a stream stalled {self.load.args.slow_stall:g} s, then read at 5 KiB/s"
        else:
            calls = [
                lambda: self.load.one("json_object", False, who=kind),
                lambda: self.load.one("json_schema", True, who=kind),
            ]
            what = "json_object plain and json_schema streamed"
        self.record(kind, what, time.monotonic())

        def body() -> None:
            got: list[str] = []
            threads = [
                threading.Thread(target=lambda c=c: got.append(c().kind), daemon=True)
                for c in calls
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            with self.lock:
                self.log.append(f"{time.strftime('%H:%M:%S')} {kind} done: {', '.join(got)}")

        thread = threading.Thread(target=body, daemon=True)
        self.side.append(thread)
        thread.start()

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


Sample = tuple[float, dict[str, tuple[int, int, int]]]  # (time, {role: (pid, rss KiB, fds)})


class Sampler:
    def __init__(self, root: int, every: float, stop: threading.Event) -> None:
        self.root, self.every, self.stop = root, every, stop
        self.samples: list[Sample] = []
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


@dataclass(frozen=True)
class ProcRow:
    """One process's memory and fds: at the soak's start, after warm-up and at the end."""

    name: str
    pids: str
    start: tuple[int, int]  # (RSS KiB, fds)
    warm: tuple[int, int] | None  # medians of RSS, max of fds over WINDOW samples
    end: tuple[int, int] | None  # medians of RSS, min of fds over WINDOW samples
    peak_kib: int
    growth: float | None  # RSS, end over warm - 1
    rss_ok: bool | None  # None: not judged (``note`` says why)
    fds_ok: bool | None
    note: str = ""


def judge_memory(
    samples: list[Sample], t0: float, warm_s: float, rss_limit: float, fds_slack: int
) -> list[ProcRow]:
    """Every process's row: the process at the end of a role (a stage restarted gets a new
    pid) is judged from ``warm_s`` after it was first seen (and after the soak's warm-up):
    RSS growth under ``rss_limit``, at most ``fds_slack`` fds more (the windows' noise, the
    requests in flight, is taken out by comparing the most after warm-up with the fewest at
    the end)."""
    if not samples:
        return []
    names = list(dict.fromkeys(name for _, snap in samples for name in snap))
    names.sort(key=lambda r: (r != "coordinator", r))
    rows = []
    for name in names:
        series = [(t, *snap[name]) for t, snap in samples if name in snap]
        pids = ", ".join(map(str, dict.fromkeys(pid for _, pid, _, _ in series)))
        first, peak = series[0], max(rss for _, _, rss, _ in series)
        start = (first[2], first[3])
        if name not in samples[-1][1]:
            rows.append(
                ProcRow(
                    name, pids, start, None, None, peak, None, None, None, "gone before the end"
                )
            )
            continue
        mine = [s for s in series if s[1] == series[-1][1]]
        after = [s for s in mine if s[0] >= max(t0, mine[0][0]) + warm_s]
        if len(after) < 2 * WINDOW:
            rows.append(
                ProcRow(
                    name,
                    pids,
                    start,
                    None,
                    (mine[-1][2], mine[-1][3]),
                    peak,
                    None,
                    None,
                    None,
                    f"started +{mine[0][0] - t0:.0f} s: too few samples after its warm-up",
                )
            )
            continue
        w, e = after[:WINDOW], after[-WINDOW:]
        warm = (int(statistics.median(s[2] for s in w)), max(s[3] for s in w))
        last = (int(statistics.median(s[2] for s in e)), min(s[3] for s in e))
        growth = (last[0] - warm[0]) / warm[0] if warm[0] else 0.0
        note = f"restarted, judged from +{after[0][0] - t0:.0f} s" if "," in pids else ""
        rows.append(
            ProcRow(
                name,
                pids,
                start,
                warm,
                last,
                peak,
                growth,
                growth < rss_limit,
                last[1] <= warm[1] + fds_slack,
                note,
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------
# the serve log


def normalize(line: str) -> str:
    line = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", "", line.strip())
    line = re.sub(r"\b(?:req|chatcmpl|cmpl|seq)-[0-9a-zA-Z]+", "<id>", line)
    line = re.sub(r"\b[0-9a-f]{8,}\b", "<hex>", line)
    line = re.sub(r"\d+(?:\.\d+)?", "N", line)
    return line[:160]


@dataclass(frozen=True)
class Trace:
    last: str  # the exception line, normalized: what makes two tracebacks the same
    count: int
    before: str  # the log line before the first one (its logger, its message)
    lines: tuple[str, ...]  # the first one's lines


def tracebacks(lines: list[str]) -> list[Trace]:
    """The distinct tracebacks of a log, most common first."""
    found: dict[str, list[tuple[str, tuple[str, ...]]]] = collections.defaultdict(list)
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        j = next(
            (
                k
                for k in range(i + 1, min(len(lines), i + 400))
                if lines[k] and not lines[k][0].isspace()
            ),
            min(len(lines), i + 400) - 1,
        )
        found[normalize(lines[j])].append((lines[i - 1] if i else "", tuple(lines[i : j + 1])))
    return sorted(
        (Trace(k, len(v), v[0][0], v[0][1]) for k, v in found.items()), key=lambda t: -t.count
    )


def references(
    url: str, jobs: dict[str, Job], args: argparse.Namespace
) -> tuple[dict[str, str], list[str], float]:
    """Every job's answer, one request at a time, plain (the slow reader's too): (texts,
    problems, mean seconds). A seeded job is asked twice: its seed must reproduce it."""
    texts: dict[str, str] = {}
    problems: list[str] = []
    seconds: list[float] = []
    for name, job in jobs.items():
        for attempt in range(2 if name.startswith("seeded#") else 1):
            started = time.monotonic()
            got = chat(url, job, args, stream=False)
            seconds.append(time.monotonic() - started)
            if got.kind != "ok" or not got.text:
                problems.append(f"{name}: {got.kind} {got.detail[:160]}")
            elif job.json_answer and not parses(got.text):
                problems.append(f"{name}: not JSON {got.text!r}")
            elif attempt and got.text != texts[name]:
                problems.append(f"{name}: the same seed drew {got.text!r}, then {texts[name]!r}")
            texts.setdefault(name, got.text if got.kind == "ok" else "")
    return texts, problems, statistics.mean(seconds)


# ---------------------------------------------------------------------------------------------
# the cluster


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


def start_cluster(
    args: argparse.Namespace, work: Path
) -> tuple[subprocess.Popen[bytes], Path | None]:
    secret: Path | None = work / "cluster.secret"
    made = subprocess.run(
        [str(BIN / "mlxppctl"), "secret", "new", str(secret)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if made.returncode != 0:
        print(f"note: no cluster secret ({made.stderr.strip()[:160]})", file=sys.stderr)
        secret = None
    ready, log_path = work / "ready", work / "serve.log"
    cmd = [
        str(BIN / "mlxppd"),
        "serve",
        "--pp-size",
        str(args.pp_size),
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--ready-file",
        str(ready),
        "--transport-port-range",
        port_range(),
        "--metrics",  # /metrics on the API listener: the stages' mlx allocator gauges
    ]
    if secret is not None:
        cmd += ["--cluster-secret-file", str(secret), "--enable-elastic-pp"]
    if args.model:
        cmd += ["--model", args.model]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=work,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    return proc, secret


def wait_ready(proc: subprocess.Popen[bytes], work: Path, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while not (work / "ready").exists():
        if proc.poll() is not None:
            raise RuntimeError(
                "serve exited before it was ready:\n" + (work / "serve.log").read_text()[-3000:]
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"serve not ready within {timeout:g} s")
        time.sleep(0.2)
    url = (work / "ready").read_text().strip()
    if urlsplit(url).hostname != "127.0.0.1":
        raise RuntimeError(f"serve listens on {url}, not 127.0.0.1")
    return url


def shutdown(proc: subprocess.Popen[bytes], chaos: Chaos | None) -> tuple[bool, str]:
    """SIGCONT what is stopped, SIGINT the serve process; SIGKILL it and its descendants when
    it does not exit in 60 s, or any of them left 10 s after it did. (clean, what happened):
    clean when it exited by itself with status 0 or 130 and took its children with it."""
    if chaos is not None:
        chaos.release()
    if proc.poll() is not None:
        return False, f"the serve process had exited already (status {proc.returncode})"
    family = descendants(proc.pid)
    for pid in family:  # a stopped process could not exit
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
        how = f"exited {time.monotonic() - began:.1f} s after SIGINT, status {proc.returncode}"
        clean = proc.returncode in (0, 130)
    except subprocess.TimeoutExpired:
        print("serve did not exit in 60 s: SIGKILL", file=sys.stderr)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        how, clean = "did not exit in 60 s after SIGINT: SIGKILLed", False
    for _ in range(100):  # its children end with it (they watch their parent)
        left = [pid for pid in family if (st := _stat(pid)) is not None and st[0] != "Z"]
        if not left:
            break
        time.sleep(0.1)
    if left:
        how += f"; {len(left)} of its processes left 10 s later, SIGKILLed"
        clean = False
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return clean, how


# ---------------------------------------------------------------------------------------------
# the report


def cell(text: str) -> str:
    return text.replace("|", "/").replace("`", "'").replace("\n", "\\n")


def minute_rows(records: list[Record], fault_log: list[tuple[float, str]]) -> list[str]:
    """One row per minute of send time: the outcome columns, 503s retried, the faults."""
    rows, last = [], int(max([r.at for r in records] + [a for a, _ in fault_log] + [0]) // 60)
    for m in range(last + 1):
        mine = [r for r in records if m * 60 <= r.at < (m + 1) * 60]
        c = collections.Counter(r.kind for r in mine)
        faults = ", ".join(k for a, k in fault_log if m * 60 <= a < (m + 1) * 60) or ""
        cols = " | ".join(str(c[k]) for k in COLUMNS)
        rows.append(
            f"| {m + 1} | {len(mine)} | {cols} | {sum(r.retries for r in mine)} | {faults} |"
        )
    c = collections.Counter(r.kind for r in records)
    rows.append(
        f"| all | {len(records)} | {' | '.join(str(c[k]) for k in COLUMNS)} | "
        f"{sum(r.retries for r in records)} | {len(fault_log)} |"
    )
    return rows


def mib(kib: int) -> str:
    return f"{kib / 1024:.0f}"


@dataclass(frozen=True)
class Criterion:
    name: str
    ok: bool
    detail: str


def report(
    args: argparse.Namespace,
    seconds: float,
    tally: Tally,
    chaos: Chaos,
    procs: list[ProcRow],
    log_text: str,
    base_s: float,
    refs_after: tuple[bool, str],
) -> list[Criterion]:
    records = tally.snapshot()
    c = collections.Counter(r.kind for r in records)
    lines = log_text.splitlines()
    traces = tracebacks(lines)
    errors = [line for line in lines if re.search(r"\bERROR\b", line)]
    failovers = [
        (line[:23] if line[:4].isdigit() else "", m)
        for line in lines
        if (m := FAILOVER_LINE.search(line))
    ]
    restarts = re.findall(r"^restarted stage \d+/\d+", log_text, re.M)
    exits = re.findall(r"stage \d+ \(pid \d+\) exited with status (-?\d+)", log_text)
    lat = sorted(tally.latencies)

    print(
        f"\nchaos soak: mlxppd serve --pp-size {args.pp_size}, {seconds:.0f} s of load, "
        f"{args.clients} clients, max_tokens {args.max_tokens}, a fault every "
        f"{args.fault_every:g}-{args.fault_every * (1 + args.fault_jitter):g} s, "
        f"seed {args.seed}\n"
    )
    print(
        "per minute, by send time (closed: by the client on purpose; cut: the slow reader's "
        "stream ended by the server; err: a connection error or an error event in a 200 "
        "stream)\n"
    )
    print(f"| minute | sent | {' | '.join(COLUMNS)} | 503 retried | faults |")
    print("|---:|---:|" + "---:|" * len(COLUMNS) + "---:|---|")
    for row in minute_rows(records, chaos.events):
        print(row)

    def examples(kind: str) -> str:
        return "; ".join(cell(e)[:300] for e in tally.examples[kind])

    print("\n| measure | value |\n|---|---|")
    by_mode = collections.Counter(r.mode.split("@")[0] for r in records)
    rows = [
        (
            "requests sent",
            f"{len(records)} (" + ", ".join(f"{k} {v}" for k, v in by_mode.items()) + ")",
        ),
        *[(f"{k} (examples)", f"{c[k]} {examples(k)}".strip()) for k in ("wrong", *LOST)],
        ("slow reader cut by the server", f"{c['cut']} {examples('cut')}".strip()),
        (
            "latency of an exact answer under chaos, s: p50 / max",
            f"{statistics.median(lat):.1f} / {lat[-1]:.1f}" if lat else "n/a",
        ),
        ("baseline: a reference, undisturbed, one at a time, s (mean)", f"{base_s:.1f}"),
        ("faults injected", ", ".join(f"{k} {v}" for k, v in chaos.injected.items()) or "none"),
        ("final references exact", ("yes" if refs_after[0] else "NO ") + refs_after[1]),
        (
            "stage restarts by the local cluster's supervisor (serve log)",
            f"{len(restarts)}; exits: "
            + (
                ", ".join(f"status {k} x{v}" for k, v in collections.Counter(exits).items())
                or "none"
            ),
        ),
        ("ERROR lines in the serve log", str(len(errors))),
    ]
    for name, value in rows:
        print(f"| {name} | {value} |")
    for note in chaos.notes:
        print(f"\nnote: {note}")
    if chaos.log:
        print("\nfaults:\n" + "\n".join(f"- {line}" for line in sorted(chaos.log)))
    print("\nrecovery: a probe request after each cluster fault, s from the fault's start\n")
    print("| fault | at, s | its action, s | recovered, s | probe |\n|---|---:|---:|---:|---|")
    for r in chaos.recoveries:
        done = f"{r.recovered_s:.1f}" if r.recovered_s is not None else "NOT"
        print(
            f"| {r.kind} | {r.at:.0f} | {r.action_s:.1f} | {done} | {cell(r.detail) or 'exact'} |"
        )
    print(
        "\nfailovers the serve log reports: "
        + (
            "; ".join(f"{stamp[11:19]} {m.group(1)} after {m.group(2)} s" for stamp, m in failovers)
            or "none"
        )
    )
    print(
        f"\nmemory and fds per process (RSS MiB; after warm-up and end: medians of {WINDOW} "
        "samples, fds the most after warm-up and the fewest at the end)\n"
    )
    print(
        "| process | pid | RSS start | RSS warm | RSS end | growth | RSS peak | fds start / "
        "warm / end | judged |\n|---|---|---:|---:|---:|---:|---:|---:|---|"
    )
    for p in procs:
        verdict = (
            "not judged"
            if p.rss_ok is None
            else f"RSS {'ok' if p.rss_ok else 'GREW'}, fds {'flat' if p.fds_ok else 'GREW'}"
        )
        print(
            f"| {p.name} | {p.pids} | {mib(p.start[0])} | "
            f"{mib(p.warm[0]) if p.warm else ''} | {mib(p.end[0]) if p.end else ''} | "
            f"{'' if p.growth is None else f'{p.growth * 100:+.1f}%'} | {mib(p.peak_kib)} | "
            f"{p.start[1]} / {p.warm[1] if p.warm else ''} / {p.end[1] if p.end else ''} | "
            f"{verdict}{'; ' + p.note if p.note else ''} |"
        )
    print(f"\ntracebacks in the serve log (every process's): {sum(t.count for t in traces)}")
    for t in traces[:8]:
        head = list(t.lines[:2]) + (["    ..."] if len(t.lines) > 7 else []) + list(t.lines[-5:])
        print(
            f"\n{t.count}x, after: {t.before[:200]}\n"
            + "\n".join(f"    {x[:200]}" for x in dict.fromkeys(head))
        )
    if errors:
        print("\nthe most common ERROR lines (ids and numbers replaced)\n")
        print("| count | line |\n|---:|---|")
        for line, n in collections.Counter(map(normalize, errors)).most_common(8):
            print(f"| {n} | `{cell(line)}` |")

    should = sum(n for k, n in c.items() if k not in ("closed", "cut"))
    lost = sum(c[k] for k in LOST)
    judged = [p for p in procs if p.rss_ok is not None]
    unrecovered = [r for r in chaos.recoveries if r.recovered_s is None]
    return [
        Criterion(
            "lost",
            lost == 0,
            f"{lost} of {should} requests that should succeed ("
            + ", ".join(f"{k} {c[k]}" for k in LOST)
            + ")",
        ),
        Criterion("wrong", c["wrong"] == 0, f"{c['wrong']} answers differ from the reference"),
        Criterion(
            "final references", refs_after[0], "exact" if refs_after[0] else refs_after[1][:200]
        ),
        Criterion("tracebacks", not traces, f"{sum(t.count for t in traces)} in the serve log"),
        Criterion(
            "RSS growth",
            bool(judged) and all(p.rss_ok for p in judged),
            f"under {args.rss_growth:g}% for {sum(bool(p.rss_ok) for p in judged)} of "
            f"{len(judged)} processes judged; max "
            + (f"{max(p.growth or 0 for p in judged) * 100:+.1f}%" if judged else "n/a")
            + f"; {len(procs) - len(judged)} not judged",
        ),
        Criterion(
            "fds flat",
            bool(judged) and all(p.fds_ok for p in judged),
            f"{sum(bool(p.fds_ok) for p in judged)} of {len(judged)} processes within "
            f"+{args.fds_slack}",
        ),
        Criterion(
            "faults",
            not chaos.failed and not unrecovered and bool(chaos.injected) and not chaos.broken,
            f"{sum(chaos.injected.values())} injected, {chaos.not_run} skipped; "
            f"{len(chaos.failed)} failed to apply"
            + (f" ({cell('; '.join(chaos.failed))[:200]})" if chaos.failed else "")
            + f"; {len(unrecovered)} of {len(chaos.recoveries)} cluster faults not recovered"
            + (f"; repartition and drain not run: {cell(chaos.broken)}" if chaos.broken else ""),
        ),
    ]


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="What it does, what it prints and how it judges: the module docstring "
        "(bench/soak.py).",
    )
    add = parser.add_argument
    add("--model", help="mlx-lm model directory (default: the embedded model)")
    add("--pp-size", type=int, default=3, help="stages of the local cluster (default 3)")
    add("--minutes", type=float, default=20.0, help="soak duration (default 20)")
    add("--seconds", type=float, help="soak duration in seconds, instead of --minutes")
    add("--clients", type=int, default=4, help="client threads looping requests (default 4)")
    add(
        "--fault-every",
        type=float,
        default=60.0,
        help="the least seconds between two faults (default 60)",
    )
    add(
        "--fault-jitter",
        type=float,
        default=1.0,
        help="gaps are drawn from [every, every * (1 + jitter)] (default 1: 60-120 s)",
    )
    add(
        "--seed",
        type=int,
        default=1,
        help="draws the fault schedule, the faults' prompts and the clients' (default 1)",
    )
    add("--max-tokens", type=int, default=32, help="of the greedy and seeded requests")
    add(
        "--slow-max-tokens",
        type=int,
        default=128,
        help=f"of each of the slow reader's {SLOW_CHOICES} choices (default 128: ~100 KB of "
        "events, more than the socket buffers and the server's write buffer hold)",
    )
    add(
        "--slow-stall",
        type=float,
        default=20.0,
        help="seconds the slow reader reads nothing after its first KiB (default 20)",
    )
    add(
        "--request-timeout",
        type=float,
        default=120.0,
        help="a request not answered by then is hung (default 120)",
    )
    add("--sample-every", type=float, default=5.0, help="seconds between RSS/fd samples")
    add(
        "--warm-up",
        type=float,
        default=60.0,
        help="seconds of load (at most a quarter of the soak) before RSS and fds are the "
        "baseline; a restarted process's own warm-up too (default 60)",
    )
    add(
        "--rss-growth",
        type=float,
        default=5.0,
        help="percent RSS may grow per process, from after warm-up to the end (default 5)",
    )
    add(
        "--fds-slack",
        type=int,
        default=3,
        help="fds a process may hold at the end above after warm-up (default 3)",
    )
    args = parser.parse_args(argv)
    args.duration = args.seconds if args.seconds is not None else args.minutes * 60
    if (
        args.duration <= 0
        or not 1 <= args.clients <= 64
        or args.fault_every <= 0
        or args.fault_jitter < 0
        or args.pp_size < 2
        or args.sample_every <= 0
    ):
        parser.error(
            "--seconds/--minutes, --fault-every and --sample-every must be > 0, "
            "--fault-jitter >= 0, --clients 1..64, --pp-size >= 2"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    duration = args.duration

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
        jobs = job_table(args)
        refs, problems, base_s = references(url, jobs, args)
        if problems:
            verdict = f"the undisturbed references failed: {'; '.join(problems)}"
            raise RuntimeError(verdict)
        sampler = Sampler(proc.pid, args.sample_every, stop)
        sampler.sample()
        tally = Tally()
        started = time.monotonic()
        end = started + duration
        load = Load(url, jobs, refs, args, tally, started)
        chaos = Chaos(proc, load, secret, args.pp_size, stop)
        for note in chaos.notes:
            print(f"note: {note}", file=sys.stderr)
        schedule = fault_schedule(
            chaos.kinds(), duration, args.fault_every, args.fault_jitter, args.seed
        )
        print(
            f"soak: {duration:.0f} s, {args.clients} clients, faults (s into the soak): "
            + ", ".join(f"{at:.0f} {k}" for at, k in schedule),
            file=sys.stderr,
        )
        threads = [
            threading.Thread(target=client, args=(n, load, end, stop), daemon=True)
            for n in range(args.clients)
        ]
        threads.append(threading.Thread(target=chaos.run, args=(schedule, end), daemon=True))
        threads.append(threading.Thread(target=sampler.run, args=(end,), daemon=True))
        for t in threads:
            t.start()
        minute = 0
        for _ in range(int(duration) + 10):  # bounded: one check a second
            if time.monotonic() >= end or proc.poll() is not None:
                break
            time.sleep(1)
            if time.monotonic() - started >= (minute + 1) * 60:
                done = [
                    r
                    for r in tally.snapshot()
                    if minute * 60 <= r.at + r.seconds < (minute + 1) * 60
                ]
                counts = collections.Counter(r.kind for r in done)
                print(
                    f"soak: minute {minute + 1}: {len(done)} done, "
                    + ", ".join(f"{k} {counts[k]}" for k in COLUMNS),
                    file=sys.stderr,
                )
                minute += 1
        if proc.poll() is not None:
            verdict = f"the serve process exited with status {proc.returncode} mid-soak"
            raise RuntimeError(verdict)
        sampler.sample()  # the end, still under load (requests in flight)
        load_end = time.monotonic()
        print("soak: load over; waiting for the last requests", file=sys.stderr)
        join_by = time.monotonic() + args.request_timeout + args.slow_stall + 20
        for t in threads + chaos.side:
            t.join(max(0.0, join_by - time.monotonic()))
        stop.set()
        chaos.release()
        stop.clear()  # the health wait below listens to it
        if not chaos.healthy(timeout=120):
            print("soak: the cluster is not healthy 120 s after the load", file=sys.stderr)
        after, problems, _ = references(url, jobs, args)
        stop.set()
        allocator = mlx_allocator(url)
        diffs = [f"{k}: {after.get(k)!r} != {v!r}" for k, v in refs.items() if after.get(k) != v]
        refs_ok = not diffs and not problems
        refs_note = "" if refs_ok else "; ".join(problems + diffs)[:600]
        print("soak: stopping the cluster", file=sys.stderr)
        exit_clean, exit_how = shutdown(proc, chaos)  # before the log is read: its last words
        log_text = (work / "serve.log").read_text(errors="replace")
        keep_log = bool(re.search(r"\bERROR\b|^Traceback", log_text, re.M))
        with sampler.lock:
            samples = list(sampler.samples)
        warm_s = min(args.warm_up, duration / 4)
        procs = judge_memory(samples, started, warm_s, args.rss_growth / 100, args.fds_slack)
        criteria = report(
            args, load_end - started, tally, chaos, procs, log_text, base_s, (refs_ok, refs_note)
        )
        criteria.append(Criterion("clean exit", exit_clean, exit_how))
        print(
            "\nmlx's allocator per stage after the load (MiB; the cache is capped and given back "
            "when a stage is idle: mlxppd/engine/mlx_memory.py)\n\n| stage | active | cache |"
            "\n|---|---:|---:|\n"
            + "\n".join(f"| {s} | {a / 2**20:.0f} | {c / 2**20:.0f} |" for s, (a, c) in allocator)
        )
        print()
        for cr in criteria:
            print(f"{'PASS' if cr.ok else 'FAIL'} {cr.name}: {cr.detail}")
        failed = [cr.name for cr in criteria if not cr.ok]
        verdict = "ok" if not failed else "FAIL: " + ", ".join(failed)
        print(f"\nverdict: {verdict}")
        return 0 if not failed else 1
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
