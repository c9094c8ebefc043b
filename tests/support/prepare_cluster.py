"""Three agents on three hosts (network namespaces, each with its own model cache) for the
``mlxppctl prepare`` tests: the coordinator on host 0, stage 0 on host 1, stage 1 on host 2,
each host's ``mlxppd.toml`` naming its own copy of the model (which may be missing or differ).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.agents import (
    CHAT,
    VENV_BIN,
    AgentProcess,
    Hosts,
    in_host_python,
    node_tables,
    start_agent,
    wait_for_status,
)
from tests.support.ctl_runner import CtlRunner
from tests.support.node_keys import roster_toml, write_agent_key

QUESTION = "What is the capital of France?"
HTTP_PORT = 8080
#: the node each host is (its config directory holds that node's key)
HOST_NODES = ("coordinator", "stage-0", "stage-1")


def cluster_text(hosts: Hosts, secret: Path, auto_prepare: bool) -> str:
    a0, a1, a2 = hosts.addresses
    head = (
        f'[cluster]\nname = "prepare-test"\npipeline_parallel_size = 2\n'
        f'secret_file = "{secret}"\nauto_prepare = {str(auto_prepare).lower()}\n\n'
    )
    nodes = node_tables(f"{a0}:19000", f"{a1}:19001", f"{a2}:19001")
    return head + nodes + roster_toml(HOST_NODES)


class Cluster:
    def __init__(self, hosts: Hosts, root: Path, env: list[dict[str, str]]) -> None:
        self.hosts, self.root, self.env = hosts, root, env
        self.agents: list[AgentProcess] = []
        self.url = f"http://{hosts.addresses[0]}:{HTTP_PORT}"
        #: reads the status from the coordinator's host, one process for all polls
        self.reader = CtlRunner(hosts.names[0])

    def config_dir(self, i: int) -> Path:
        return self.root / f"host{i}" / "etc"

    def cache_dir(self, i: int) -> Path:
        return self.root / f"host{i}" / "cache"

    def start(self, i: int) -> AgentProcess:
        agent = start_agent(self.hosts, i, self.config_dir(i), self.env[i])
        self.agents = [a for a in self.agents if a.host != i] + [agent]
        return agent

    def agent(self, i: int) -> AgentProcess:
        return next(a for a in self.agents if a.host == i)

    def write_cluster(self, text: str) -> None:
        for i in range(3):
            tmp = self.config_dir(i) / "cluster.toml.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.config_dir(i) / "cluster.toml")

    def ctl(self, *args: str) -> list[str]:
        return [
            "ip", "netns", "exec", self.hosts.names[0], str(VENV_BIN / "mlxppctl"), *args,
            "--config-dir", str(self.config_dir(0)),
        ]  # fmt: skip

    def status(self) -> dict[str, Any]:
        """``mlxppctl status --json`` on the coordinator's host ({}: it is (re)starting)."""
        done = self.reader.ctl("status", "--json", "--config-dir", str(self.config_dir(0)))
        assert done.returncode in (0, 1, 3), done.stderr
        if done.returncode == 3:  # the coordinator's agent is (re)starting
            return {}
        document: dict[str, Any] = json.loads(done.stdout)
        return document

    def wait_status(self, predicate: Any, timeout: float = 180) -> dict[str, Any]:
        def logs() -> str:
            return "\n".join(a.log()[-3000:] for a in self.agents)

        return wait_for_status(self.status, lambda d: bool(d) and predicate(d), timeout, logs)

    def get(self, path: str) -> dict[str, Any]:
        code = (
            "import json, sys, httpx\nr = httpx.get(sys.argv[1], timeout=30)\n"
            "print(json.dumps({'status': r.status_code, 'body': r.json()}))"
        )
        result: dict[str, Any] = in_host_python(self.hosts, 0, code, self.url + path)
        return result

    def chat(self, model: str | None = None, max_tokens: int = 16) -> dict[str, Any]:
        extra = [model] if model else []
        result: dict[str, Any] = in_host_python(
            self.hosts, 0, CHAT, self.url, QUESTION, str(max_tokens), *extra
        )
        return result


def identities(document: dict[str, Any]) -> list[str | None]:
    return [(s.get("identity") or {}).get("state") for s in document.get("stages", [])]


def prepare_of(document: dict[str, Any], node: str) -> dict[str, Any]:
    job = document["coordinator"].get("prepare") or {}
    return next((n for n in job.get("nodes", []) if n["node"] == node), {})


@contextmanager
def prepare_cluster(root: Path, models: list[Path]) -> Iterator[Cluster]:
    """The three agents, host ``i``'s ``mlxppd.toml`` naming ``models[i]``; auto_prepare off."""
    secret = root / "cluster.secret"
    secret.write_text("prepare-test-secret-0123456789abcdef\n")
    secret.chmod(0o600)
    hosts = Hosts.create(3)
    env = [
        {**os.environ, "MLXPP_MODEL_CACHE": str(root / f"host{i}" / "cache"), "HF_HUB_OFFLINE": "1"}
        for i in range(3)
    ]
    running = Cluster(hosts, root, env)
    try:
        text = cluster_text(hosts, secret, auto_prepare=False)
        for i in range(3):
            config_dir = running.config_dir(i)
            config_dir.mkdir(parents=True)
            (config_dir / "cluster.toml").write_text(text)
            write_agent_key(config_dir, HOST_NODES[i])
            (config_dir / "mlxppd.toml").write_text(
                f'model = "{models[i]}"\nhttp_host = "0.0.0.0"\nhttp_port = {HTTP_PORT}\n'
                f'reconcile_interval_s = 2.0\nstate_dir = "{root / f"host{i}"}"\n'
            )
        for i in (1, 2, 0):
            running.start(i)
        yield running
    finally:
        for agent in running.agents:
            agent.stop(timeout=30)
        running.reader.close()
        hosts.destroy()
