"""``[operators]`` follows an agent's reload, on a live cluster of three real ``mlxppd agent``
processes on loopback (a coordinator, two stages, each with its own config directory).

Without ``[operators]`` the coordinator warns at start and the cluster secret signs admin
requests (legacy mode). Once every host's cluster.toml lists an operator, the secret's
signatures are refused and only that operator's key drains; replacing the operator revokes the
old key at once; removing the table brings the legacy mode back. No agent restarts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxppd.runtime.local_cluster import free_port
from mlxppd.wire.operator_key import OperatorKey, write_new_operator_key
from tests.support.agents import (
    AgentProcess,
    node_tables,
    start_ready_agents,
    write_agent_dirs,
    write_cluster_toml,
)
from tests.support.ctl_runner import CtlRunner
from tests.support.node_keys import roster_toml

pytestmark = pytest.mark.slow

NODES = ("coordinator", "stage-0", "stage-1")
SECRET = "operator-reload-secret-0123456789ab"
LEGACY_WARNING = "the cluster TOML lists no [operators]"


class Cluster:
    def __init__(self, root: Path, ports: list[int], http: int) -> None:
        self.root = root
        self.config_dirs = [root / node for node in NODES]
        self.url = f"http://127.0.0.1:{http}"
        self.agents: list[AgentProcess] = []
        self.ctl_runner = CtlRunner()
        self.text = (
            f'[cluster]\nname = "operators"\npipeline_parallel_size = 2\n'
            f'secret_file = "{root / "cluster.secret"}"\n\n'
            + node_tables(*(f"127.0.0.1:{p}" for p in ports))
            + roster_toml(NODES)
        )

    def write(self, operators: list[OperatorKey]) -> None:
        """Every host's cluster.toml with ``operators`` listed (none: no table)."""
        text = self.text
        if operators:
            text += "\n[operators]\n" + "".join(f"{k.operators_line}\n" for k in operators)
        write_cluster_toml(self.config_dirs, text)

    def ctl(self, *args: str) -> tuple[int, str]:
        """An admin command against the coordinator, from its own config directory (where
        the cluster secret is): its exit status and its stderr."""
        done = self.ctl_runner.ctl(*args, "--config-dir", str(self.config_dirs[0]))
        return done.returncode, done.stderr

    def until(self, args: tuple[str, ...], code: int, timeout: float = 60) -> str:
        """Repeat ``args`` until it exits with ``code`` (a reload takes a moment)."""
        deadline = time.monotonic() + timeout
        while True:
            got, err = self.ctl(*args)
            if got == code:
                return err
            assert time.monotonic() < deadline, (got, err, self.agents[0].log()[-3000:])
            time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, chat_llama: Path, model_cache: Path
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("operators")
    (root / "cluster.secret").write_text(SECRET + "\n")
    (root / "cluster.secret").chmod(0o600)
    http = free_port()
    running = Cluster(root, [free_port() for _ in NODES], http)
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    env.pop("MLXPP_NODE_KEY_FILE", None)
    env.pop("MLXPP_OPERATOR_KEY_FILE", None)
    try:
        write_agent_dirs(
            running.config_dirs,
            NODES,
            f'node_id = "{{node}}"\nmodel = "{chat_llama}"\nhttp_port = {http}\n'
            "reconcile_interval_s = 1.0\n",
        )
        running.write([])
        running.agents = start_ready_agents(running.config_dirs, env)
        yield running
    finally:
        for agent in running.agents:
            agent.stop(timeout=30)
        running.ctl_runner.close()


def test_operators_listed_by_a_reload_replace_the_secret_and_can_be_revoked(
    cluster: Cluster, tmp_path: Path
) -> None:
    alice = write_new_operator_key(tmp_path / "alice.key", "alice")
    bob = write_new_operator_key(tmp_path / "bob.key", "bob")
    as_alice = ("--operator-key", str(tmp_path / "alice.key"))
    as_bob = ("--operator-key", str(tmp_path / "bob.key"))
    # Legacy mode: the secret signs, and the coordinator said once what that means.
    assert cluster.ctl("drain") == (0, "")
    assert cluster.ctl("resume") == (0, "")
    assert cluster.agents[0].log().count(LEGACY_WARNING) == 1

    cluster.write([alice])
    err = cluster.until(("drain",), 3)
    assert "takes only operator signatures" in err and "--operator-key" in err
    assert cluster.ctl("drain", *as_alice) == (0, "")
    assert cluster.ctl("resume", *as_alice) == (0, "")
    assert "bad_signature" in cluster.ctl("drain", *as_bob)[1]

    # Alice's line replaced by Bob's: her key is refused from the reload on.
    cluster.write([bob])
    err = cluster.until(("status", *as_alice), 3)
    assert "bad_signature" in err
    assert cluster.ctl("status", *as_bob)[0] == 0

    # The table removed: legacy mode again.
    cluster.write([])
    cluster.until(("status",), 0)
    assert cluster.agents[0].process.poll() is None  # the same agent all along
