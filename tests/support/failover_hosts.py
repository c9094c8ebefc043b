"""A failover cluster on network namespaces for the netns failover suites: five hosts under
``mlxppd agent`` (a coordinator, three stages, a standby), real streams from the coordinator's
host, and the means to lose a stage as an operator's bad week would (a kill, a hang, a cut
cable) and to read what the coordinator made of it (its log, its status, its metrics)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlxppd.wire.secret import write_new_secret
from tests.support.agents import AgentProcess, Hosts, start_agent, wait_for_status
from tests.support.ctl_runner import CtlRunner
from tests.support.node_keys import roster_toml, write_agent_key

HTTP_PORT = 8080
QUESTIONS = [
    "Tell me a story about a dragon.",
    "Explain how a steam engine works.",
    "Write a poem about the sea.",
    "What is the capital of France?",
]
SEEDED = {"temperature": 0.8, "seed": 1234}

#: the cluster TOML; ``str.format`` fills secret, a (addresses), timeout, grace and restore
CLUSTER = """\
[cluster]
name = "failover-test"
pipeline_parallel_size = 3
secret_file = "{secret}"
layers = ["0-9", "10-19", "20-29"]

[cluster.failover]
heartbeat_interval_s = 0.5
heartbeat_timeout_s = {timeout}
reconnect_grace_s = {grace}
recovery_timeout_s = 300
{restore}

[[nodes]]
id = "coordinator"
address = "{a[0]}:19000"
role = "hybrid"

[[nodes]]
id = "stage-0"
address = "{a[1]}:19001"
role = "pipeline_stage"
stage = 0

[[nodes]]
id = "stage-1"
address = "{a[2]}:19001"
role = "pipeline_stage"
stage = 1

[[nodes]]
id = "stage-2"
address = "{a[3]}:19001"
role = "pipeline_stage"
stage = 2

[[nodes]]
id = "standby-0"
address = "{a[4]}:19001"
role = "standby"
"""
#: the node each host is, in host order (its agent's config directory holds that node's key)
HOST_NODES = ("coordinator", "stage-0", "stage-1", "stage-2", "standby-0")
CLUSTER += roster_toml(HOST_NODES)  # base64 holds no braces for str.format to read

# Streams every request of argv[2] (JSON) at once; when the first has sent argv[4] chunks,
# sends signal argv[5] to pid argv[3] (0: none) and creates the file argv[6].
STREAMS = """
import json, os, sys, threading, httpx
url, specs, pid, after, signame, marker = sys.argv[1], json.loads(sys.argv[2]), \\
    int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
out = [None] * len(specs)
def run(i, spec):
    body = {"messages": [{"role": "user", "content": spec["q"]}], "max_tokens": spec["n"],
            "stream": True, **spec["sampling"]}
    text, chunks, done, error = "", 0, False, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        lines = r.iter_lines() if r.status_code == 200 else []
        if r.status_code != 200:  # refused before streaming: the body says why
            error = {"message": r.read().decode(errors="replace")[:2000]}
        for line in lines:
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                break
            if event["choices"]:
                text += event["choices"][0]["delta"].get("content") or ""
            chunks += 1
            if i == 0 and chunks == after:
                if pid:
                    os.kill(pid, getattr(__import__("signal"), signame))
                open(marker, "w").close()
    out[i] = {"status": r.status_code, "text": text, "done": done, "error": error}
threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(specs)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""


# Runs each request of argv[2] (JSON) in a loop of its own, one request after the other,
# until the file argv[3] exists; prints every result of every loop.
LOOPS = """
import json, os, sys, threading, httpx
url, specs, stop = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
out = [[] for _ in specs]
def one(spec):
    body = {"messages": [{"role": "user", "content": spec["q"]}], "max_tokens": spec["n"],
            "stream": True, **spec["sampling"]}
    text, done, error = "", False, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "text": "", "done": False,
                    "error": {"message": r.read().decode(errors="replace")[:2000]}}
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    break
                if event["choices"]:
                    text += event["choices"][0]["delta"].get("content") or ""
    return {"status": r.status_code, "text": text, "done": done, "error": error}
def loop(i, spec):
    while not os.path.exists(stop):
        out[i].append(one(spec))
threads = [threading.Thread(target=loop, args=(i, s)) for i, s in enumerate(specs)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""


class Cluster:
    def __init__(self, hosts: Hosts, root: Path, env: dict[str, str]):
        self.hosts, self.root, self.env = hosts, root, env
        self.agents: dict[int, AgentProcess] = {}
        self.url = f"http://{hosts.addresses[0]}:{HTTP_PORT}"
        #: reads the status and metrics from the coordinator's host, one process for all polls
        self.reader = CtlRunner(hosts.names[0])

    def config_dir(self, host: int) -> Path:
        return self.root / f"host{host}" / "etc"

    def start(self, host: int) -> AgentProcess:
        agent = start_agent(self.hosts, host, self.config_dir(host), self.env)
        self.agents[host] = agent
        return agent

    def restart(self, host: int, *more: int) -> AgentProcess:
        """Start host ``host``'s agent (and those of hosts ``more``, all at once) again, once
        its killed one is gone (as systemd's Restart=on-failure does), and wait until each is
        ready; host ``host``'s agent."""
        for each in (host, *more):
            self.agents[each].process.wait(30)
            self.agents[each].notify.close()
        started = [self.start(each) for each in (host, *more)]
        for agent in started:
            agent.notify.wait_for("READY", timeout=300)
        return started[0]

    def logs(self) -> str:
        return "\n".join(f"--- host {h}\n{a.log()[-3000:]}" for h, a in self.agents.items())

    def coordinator_log(self) -> str:
        return self.agents[0].log()

    def streams(
        self, specs: list[dict[str, Any]], pid: int = 0, after: int = 10, sig: str = "SIGKILL"
    ) -> tuple[subprocess.Popen[str], Path]:
        """Start the streams on the coordinator's host; (the process, its signal marker)."""
        marker = self.root / f"signalled-{time.monotonic_ns()}"
        argv = [sys.executable, "-c", STREAMS, self.url, json.dumps(specs), str(pid),
                str(after), sig, str(marker)]  # fmt: skip
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts.names[0], *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        return proc, marker

    def loops(self, specs: list[dict[str, Any]]) -> tuple[subprocess.Popen[str], Path]:
        """Each request of ``specs`` in a loop of its own on the coordinator's host, one after
        the other, until the returned file is created; (the process, that file)."""
        stop = self.root / f"stop-{time.monotonic_ns()}"
        argv = [sys.executable, "-c", LOOPS, self.url, json.dumps(specs), str(stop)]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts.names[0], *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        return proc, stop

    def status(self) -> dict[str, Any]:
        """``mlxppctl status --json`` on the coordinator's host."""
        done = self.reader.ctl("status", "--json", "--config-dir", str(self.config_dir(0)))
        assert done.returncode in (0, 1), done.stderr
        document: dict[str, Any] = json.loads(done.stdout)
        return document

    def metrics(self) -> str:
        return self.reader.get(f"{self.url}/metrics")

    def wait_status(self, predicate: Any, timeout: float = 240) -> dict[str, Any]:
        return wait_for_status(self.status, predicate, timeout, self.logs)

    def wait_log(self, pattern: str, after: int = 0, timeout: float = 240) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while (found := re.search(pattern, self.coordinator_log()[after:])) is None:
            assert time.monotonic() < deadline, f"no {pattern!r}:\n{self.logs()}"
            time.sleep(0.2)
        return found

    def wait_idle(self) -> None:
        """Nothing leaks: every stage in the pipeline holds no KV and no sequence."""
        self.wait_status(
            lambda d: (
                d["coordinator"]["ready"]
                and all(
                    s.get("kv_used_bytes") == 0 and s.get("in_flight") == 0 for s in d["stages"]
                )
            )  # fmt: skip
        )

    def link(self, host: int, state: str) -> None:
        """Host ``host``'s cable in (``up``) or out (``down``)."""
        done = self.hosts.run(host, "ip", "link", "set", "eth0", state)
        assert done.returncode == 0, done.stderr


def running_cluster(
    root: Path, model_cache: Path, timeout: float, grace: float, restore: str = ""
) -> Iterator[Cluster]:
    """The five hosts' agents started (standby first, coordinator last) and ready; every
    agent stopped and every namespace gone on the way out. ``restore``: more lines of the
    ``[cluster.failover]`` table."""
    secret = root / "cluster.secret"
    write_new_secret(secret)
    hosts = Hosts.create(5)
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    running = Cluster(hosts, root, env)
    try:
        text = CLUSTER.format(
            secret=secret, a=hosts.addresses, timeout=timeout, grace=grace, restore=restore
        )
        for host in range(5):
            running.config_dir(host).mkdir(parents=True)
            (running.config_dir(host) / "cluster.toml").write_text(text)
            write_agent_key(running.config_dir(host), HOST_NODES[host])
            write_settings(running, host)
        for host in (4, 3, 2, 1, 0):
            running.start(host)
        for agent in running.agents.values():
            try:
                agent.notify.wait_for("READY", timeout=300)
            except AssertionError:
                raise AssertionError(agent.log()[-4000:]) from None
        yield running
    finally:
        pids = [a.process.pid for a in running.agents.values()]
        for agent in running.agents.values():
            with_cont(agent)
            agent.stop(timeout=60)
        running.reader.close()
        hosts.destroy()
        assert all(_gone(pid) for pid in pids), "an agent outlived the test"


def write_settings(cluster: Cluster, host: int, memory_budget_bytes: int | None = None) -> None:
    budget = f"memory_budget_bytes = {memory_budget_bytes}\n" if memory_budget_bytes else ""
    (cluster.config_dir(host) / "mlxppd.toml").write_text(
        f'http_host = "0.0.0.0"\nhttp_port = {HTTP_PORT}\nreconcile_interval_s = 1.0\n'
        f'drain_timeout_s = 30.0\nstate_dir = "{cluster.root / f"host{host}"}"\n{budget}'
        # No kept prompt prefixes: these tests check that a failover leaves no KV behind.
        "prompt_cache_entries = 0\n"
    )


def with_cont(agent: AgentProcess) -> None:
    if agent.process.poll() is None:
        os.kill(agent.process.pid, signal.SIGCONT)


def _gone(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def finished(proc: subprocess.Popen[str], timeout: float = 600) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    result: list[dict[str, Any]] = json.loads(out)
    return result


def wait_file(path: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def specs(n: int, count: int, seeded: bool = False, first: int = 0) -> list[dict[str, Any]]:
    """``count`` greedy requests of ``n`` tokens (the last one seeded sampling: ``seeded``),
    asking ``QUESTIONS`` from ``first`` on."""
    out = [{"q": q, "n": n, "sampling": {"temperature": 0}} for q in QUESTIONS[first:][:count]]
    if seeded:
        out[-1]["sampling"] = dict(SEEDED)
    return out


def check(
    results: list[dict[str, Any]],
    want: list[dict[str, Any]],
    reference: dict[tuple[str, int], str],
    seeded_text: str | None = None,
    logs: str = "",
) -> None:
    """Every stream ended, with exactly the reference's text (``logs``: shown if not)."""
    for result, spec in zip(results, want, strict=True):
        assert result["error"] is None and result["done"], (result, logs[-6000:])
        if spec["sampling"].get("temperature"):
            assert result["text"] == seeded_text
        else:
            assert result["text"] == reference[(spec["q"], spec["n"])], (spec, result)
