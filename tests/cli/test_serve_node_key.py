"""``mlxppd serve --distributed-config`` and the node keys: a node starts only holding the key
the TOML's ``[roster]`` lists for it. A TOML from before node keys (no ``[roster]``), a host
holding another node's key, a node whose line was removed: each is refused at start with one
line that says what to do, before any model is loaded or port bound."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxppd.runtime.local_cluster import free_port
from tests.support.agents import node_tables
from tests.support.mlxppctl import write_secret
from tests.support.node_keys import roster_toml, write_node_keys

NODES = ("coordinator", "stage-0", "stage-1")


def cluster_text(roster: tuple[str, ...] = NODES) -> str:
    nodes = node_tables(*(f"127.0.0.1:{free_port()}" for _ in NODES))
    head = '[cluster]\nname = "keys"\npipeline_parallel_size = 2\n\n'
    return head + nodes + (roster_toml(roster) if roster else "")


def serve(
    tmp_path: Path, cli_env: dict[str, str], toml: str, node: str, *flags: str
) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "cluster.toml"
    config.write_text(toml)
    secret = write_secret(tmp_path / "cluster.secret", b"serve-node-key-secret-0123456789")
    env = {k: v for k, v in cli_env.items() if k != "MLXPP_NODE_KEY_FILE"}
    return subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve",
         "--distributed-config", str(config), "--node-id", node,
         "--cluster-secret-file", str(secret), *flags],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("mlxppd: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("node", ["stage-0", "coordinator"])
def test_a_toml_without_a_roster_is_refused_with_the_migration_step(
    tmp_path: Path, cli_env: dict[str, str], node: str
) -> None:
    keys = write_node_keys(tmp_path / "keys", NODES)
    error = one_line(
        serve(tmp_path, cli_env, cluster_text(roster=()), node, "--node-key-file", str(keys[node]))
    )
    assert "mlxppctl node-key new" in error and "[roster]" in error, error
    assert f'{node} = "<public key>"' in error  # the line to add, for this node


def test_a_node_holding_another_nodes_key_is_refused_naming_the_roster(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    keys = write_node_keys(tmp_path / "keys", NODES)
    error = one_line(
        serve(tmp_path, cli_env, cluster_text(), "stage-0", "--node-key-file", str(keys["stage-1"]))
    )
    assert "is not node stage-0's key" in error and "[roster] lists" in error, error


def test_a_node_removed_from_the_roster_is_refused(tmp_path: Path, cli_env: dict[str, str]) -> None:
    keys = write_node_keys(tmp_path / "keys", NODES)
    toml = cluster_text(roster=("coordinator", "stage-1"))
    error = one_line(
        serve(tmp_path, cli_env, toml, "stage-0", "--node-key-file", str(keys["stage-0"]))
    )
    assert "node stage-0 is not in [roster]" in error, error


def test_a_node_without_a_key_file_is_told_how_to_make_one(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    error = one_line(serve(tmp_path, cli_env, cluster_text(), "stage-0"))
    assert str(tmp_path / "node.key") in error and "mlxppctl node-key new" in error, error


def test_the_key_beside_the_toml_is_found_without_a_flag(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """node.key beside --distributed-config is the last place looked: there, another node's
    key is read (and refused), which shows it was the file used."""
    write_node_keys(tmp_path, ["stage-1"])["stage-1"].rename(tmp_path / "node.key")
    error = one_line(serve(tmp_path, cli_env, cluster_text(), "stage-0"))
    assert "is not node stage-0's key" in error and str(tmp_path / "node.key") in error, error
