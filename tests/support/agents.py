"""Hosts for agent tests: Linux network namespaces joined by a bridge, and agents run in them.

Each "host" is a network namespace with its own address on a private /24; a fifth namespace
holds the bridge, so nothing is added to the machine's own network. An agent gets its own
config directory and a NOTIFY_SOCKET datagram socket the test reads, as systemd would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.node_keys import write_agent_key

VENV_BIN = Path(sys.executable).parent


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns add) needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    probe = f"mlxpp-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Hosts:
    """Namespaces ``names[i]`` with address ``addresses[i]`` on one bridge."""

    names: list[str]
    addresses: list[str]
    bridge: str

    _made = 0

    @classmethod
    def create(cls, count: int) -> Hosts:
        cls._made += 1
        tag = f"mlxpp{os.getpid() % 100000}x{cls._made}"
        bridge = f"{tag}-br"
        _ip("netns", "add", bridge)
        hosts = cls([], [], bridge)
        try:
            _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", bridge, "link", "set", "br0", "up")
            for i in range(count):
                name = f"{tag}-h{i}"
                _ip("netns", "add", name)
                hosts.names.append(name)
                _ip(
                    "link", "add", "eth0", "netns", name, "type", "veth",
                    "peer", "name", f"p{i}", "netns", bridge,
                )  # fmt: skip
                address = f"10.231.0.{i + 1}"
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", bridge, "link", "set", f"p{i}", "master", "br0", "up")
                hosts.addresses.append(address)
        except BaseException:
            hosts.destroy()
            raise
        return hosts

    def destroy(self) -> None:
        for name in [*self.names, self.bridge]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def run(
        self, index: int, *argv: str, timeout: float = 120, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run a command on host ``index`` and wait for it."""
        return subprocess.run(
            ["ip", "netns", "exec", self.names[index], *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )


class NotifySocket:
    """The receiving end of NOTIFY_SOCKET: collects the agent's sd_notify datagrams."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path.unlink(missing_ok=True)  # a restarted agent's socket replaces the old one
        self.sock.bind(str(path))
        self.messages: list[dict[str, str]] = []

    def _drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a datagram, then take every one already queued."""
        self.sock.settimeout(timeout)
        while True:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                return
            lines = data.decode().splitlines()
            self.messages.append(dict(line.split("=", 1) for line in lines if "=" in line))
            self.sock.settimeout(0)

    def wait_for(self, key: str, timeout: float, after: int = 0) -> dict[str, str]:
        """The first message at index >= ``after`` holding ``key``."""
        deadline = time.monotonic() + timeout
        while True:
            for message in self.messages[after:]:
                if key in message:
                    return message
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key} within {timeout} s; got {self.messages}")
            self._drain(min(left, 0.5))

    def close(self) -> None:
        self.sock.close()


@dataclass
class AgentProcess:
    host: int
    config_dir: Path
    process: subprocess.Popen[bytes]
    notify: NotifySocket
    log_path: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)
        finally:
            self.notify.close()


def start_agent(
    hosts: Hosts, index: int, config_dir: Path, env: dict[str, str], *flags: str
) -> AgentProcess:
    notify = NotifySocket(config_dir.parent / f"notify-{index}.sock")
    log_path = config_dir.parent / f"agent-{index}.log"
    argv = [str(VENV_BIN / "mlxppd"), "agent", "--config-dir", str(config_dir), *flags]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            ["ip", "netns", "exec", hosts.names[index], *argv],
            env={**env, "NOTIFY_SOCKET": str(notify.path)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return AgentProcess(index, config_dir, process, notify, log_path)


def in_host_python(hosts: Hosts, index: int, code: str, *args: str, timeout: float = 180) -> Any:
    """Run ``code`` with this venv's python on host ``index``; it prints one JSON value."""
    done = hosts.run(index, sys.executable, "-c", code, *args, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"host {index}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


CHAT = """
import json, sys, httpx
url, question, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
        "temperature": 0}
if len(sys.argv) > 4:
    body["model"] = sys.argv[4]
r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
print(json.dumps({"status": r.status_code, "body": r.json(),
                  "retry_after": r.headers.get("Retry-After")}))
"""

STREAM_AND_SIGNAL = """
import json, os, signal, sys, httpx
url, question, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
pids = [int(p) for p in sys.argv[4].split(",")]
body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True}
chunks, signalled, done = [], False, False
with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
        if delta:
            chunks.append(delta)
            if not signalled:
                for pid in pids:
                    os.kill(pid, signal.SIGTERM)
                signalled = True
print(json.dumps({"status": r.status_code, "text": "".join(chunks), "done": done,
                  "signalled": signalled}))
"""


def start_local_agent(config_dir: Path, env: dict[str, str], *flags: str) -> AgentProcess:
    """An agent on this host's own network (loopback clusters)."""
    # Beside the config directory, not in it: the agent watches that directory.
    notify = NotifySocket(config_dir.parent / f"{config_dir.name}.notify")
    log_path = config_dir.parent / f"{config_dir.name}.log"
    argv = [str(VENV_BIN / "mlxppd"), "agent", "--config-dir", str(config_dir), *flags]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            env={**env, "NOTIFY_SOCKET": str(notify.path)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return AgentProcess(-1, config_dir, process, notify, log_path)


def write_agent_dirs(config_dirs: Sequence[Path], node_ids: Sequence[str], host_toml: str) -> None:
    """Each node's config directory, as on its own host: its node key (``node.key``) and its
    ``mlxppd.toml``, ``host_toml`` with ``{node}`` replaced by the node's id."""
    for node, etc in zip(node_ids, config_dirs, strict=True):
        etc.mkdir()
        write_agent_key(etc, node)
        (etc / "mlxppd.toml").write_text(host_toml.replace("{node}", node))


def write_cluster_toml(config_dirs: Sequence[Path], text: str) -> None:
    """``text`` as every host's cluster.toml, each replaced at once (an agent may be reading)."""
    for config_dir in config_dirs:
        tmp = config_dir / "cluster.toml.tmp"
        tmp.write_text(text)
        os.replace(tmp, config_dir / "cluster.toml")


def start_ready_agents(config_dirs: Sequence[Path], env: dict[str, str]) -> list[AgentProcess]:
    """One local agent per config dir, the last first (stages before the coordinator, which
    connects to them), each waited for until READY; returned in the dirs' order. An agent
    that never gets ready fails the test with the tail of its log."""
    started = {i: start_local_agent(config_dirs[i], env) for i in reversed(range(len(config_dirs)))}
    agents = [started[i] for i in range(len(config_dirs))]
    for agent in agents:
        try:
            agent.notify.wait_for("READY", timeout=300)
        except AssertionError:
            raise AssertionError(agent.log()[-4000:]) from None
    return agents


def node_tables(coordinator: str, stage0: str, stage1: str) -> str:
    """The [[nodes]] of a two-stage cluster TOML at these host:port addresses."""
    return (
        f'[[nodes]]\nid = "coordinator"\naddress = "{coordinator}"\nrole = "hybrid"\n\n'
        f'[[nodes]]\nid = "stage-0"\naddress = "{stage0}"\nrole = "pipeline_stage"\nstage = 0\n\n'
        f'[[nodes]]\nid = "stage-1"\naddress = "{stage1}"\nrole = "pipeline_stage"\nstage = 1\n'
    )


def wait_for_status(
    read: Any, predicate: Any, timeout: float, describe: Any = None
) -> dict[str, Any]:
    """Poll ``read()`` (a status document) until ``predicate`` holds; fail with the last one."""
    deadline = time.monotonic() + timeout
    while True:
        document: dict[str, Any] = read()
        if predicate(document):
            return document
        if time.monotonic() > deadline:
            extra = describe() if describe is not None else ""
            raise AssertionError(f"status never matched: {json.dumps(document)[:3000]}\n{extra}")
        time.sleep(0.3)
