"""``mlxppctl node-key new|public``, run as an operator does: a private key file of mode 0600,
never replaced by accident, and the ``[roster]`` line of its public half, which parses."""

from __future__ import annotations

import stat
import tomllib
from pathlib import Path

import pytest

from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.wire.node_key import load_node_key
from tests.support.agents import node_tables
from tests.support.mlxppctl import clean_env, mlxppctl, one_line_error

CLUSTER = '[cluster]\nname = "keys"\npipeline_parallel_size = 2\n\n' + node_tables(
    "10.0.0.1:19000", "10.0.0.2:19001", "10.0.0.3:19001"
)


def roster_of(line: str) -> dict[str, str]:
    table: dict[str, str] = tomllib.loads(f"[roster]\n{line}")["roster"]
    return table


def test_new_writes_a_private_key_and_prints_its_roster_line(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    done = mlxppctl("node-key", "new", str(path), "--node-id", "stage-0", env=clean_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    [line] = done.stdout.splitlines()
    key = load_node_key("stage-0", flag_path=path)
    assert roster_of(line) == {"stage-0": key.public_text}
    assert "[roster]" in done.stderr
    # The private half is never printed; the file holds nothing but it.
    assert path.read_text().strip() not in done.stdout + done.stderr


def test_the_printed_line_completes_a_cluster_toml(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    lines = []
    for node in ("coordinator", "stage-0", "stage-1"):
        done = mlxppctl(
            "node-key", "new", str(tmp_path / f"{node}.key"), "--node-id", node, env=env
        )
        assert done.returncode == 0, done.stderr
        lines.append(done.stdout)
    cluster = parse_cluster_config(CLUSTER + "\n[roster]\n" + "".join(lines), "cluster.toml")
    for node in ("coordinator", "stage-0", "stage-1"):
        assert (
            cluster.node_roster.key_of(node)
            == load_node_key(node, flag_path=tmp_path / f"{node}.key").public
        )


def test_new_refuses_to_replace_a_key_unless_forced(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    path = tmp_path / "node.key"
    assert mlxppctl("node-key", "new", str(path), env=env).returncode == 0
    before = path.read_bytes()
    error = one_line_error(mlxppctl("node-key", "new", str(path), env=env), 2)
    assert f"{path} already exists" in error and "--force" in error and "[roster]" in error
    assert path.read_bytes() == before
    forced = mlxppctl("node-key", "new", str(path), "--force", env=env)
    assert forced.returncode == 0, forced.stderr
    assert path.read_bytes() != before
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("node", ["stage-0", "host.lab"])
def test_public_prints_the_same_line_as_new(tmp_path: Path, node: str) -> None:
    """Also for an id holding a '.', which TOML would read as a nested table unquoted."""
    env = clean_env(tmp_path)
    path = tmp_path / "node.key"
    made = mlxppctl("node-key", "new", str(path), "--node-id", node, env=env)
    assert made.returncode == 0, made.stderr
    again = mlxppctl("node-key", "public", str(path), "--node-id", node, env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout == made.stdout
    assert list(roster_of(again.stdout)) == [node]


def test_public_of_a_file_that_holds_no_key_names_the_command_that_makes_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "node.key"
    path.write_text("not a key\n")
    path.chmod(0o600)
    error = one_line_error(mlxppctl("node-key", "public", str(path), env=clean_env(tmp_path)), 2)
    assert str(path) in error and "mlxppctl node-key new" in error


def test_public_refuses_a_key_others_can_read(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    path = tmp_path / "node.key"
    assert mlxppctl("node-key", "new", str(path), env=env).returncode == 0
    path.chmod(0o644)
    error = one_line_error(mlxppctl("node-key", "public", str(path), env=env), 2)
    assert str(path) in error and "chmod 600" in error
