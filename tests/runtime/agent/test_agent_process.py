"""One real ``mlxppd`` process on loopback: ``check``, and the agent's sd_notify conversation
(READY once serving, WATCHDOG, RELOADING + READY on SIGHUP, STOPPING and exit 0 on SIGTERM)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mlxppd.runtime.local_cluster import free_port
from tests.support.agents import NotifySocket, node_tables
from tests.support.node_keys import roster_toml, write_agent_key

pytestmark = pytest.mark.slow

MLXPPD = str(Path(sys.executable).parent / "mlxppd")

CLUSTER = '[cluster]\npipeline_parallel_size = 2\nsecret_file = "cluster.secret"\n\n'
NODES = ("coordinator", "stage-0", "stage-1")


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "cluster.secret").write_text("process-test-secret-0123456789\n")
    (etc / "cluster.secret").chmod(0o600)  # a secret readable by others is refused
    nodes = node_tables(*(f"127.0.0.1:{free_port()}" for _ in range(3)))
    (etc / "cluster.toml").write_text(CLUSTER + nodes + roster_toml(NODES))
    (etc / "mlxppd.toml").write_text('node_id = "stage-1"\n')
    write_agent_key(etc, "stage-1")
    return etc


def run_check(
    config_dir: Path, env: dict[str, str], *flags: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MLXPPD, "check", "--config-dir", str(config_dir), *flags],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_check_reports_the_node_and_its_layers(config_dir: Path, cli_env: dict[str, str]) -> None:
    done = run_check(config_dir, cli_env)
    assert done.returncode == 0, done.stderr
    assert "configuration ok: node stage-1 (pipeline_stage 1, layers 15-29)" in done.stdout


def test_check_without_a_node_id_on_a_loopback_cluster_is_ambiguous(
    config_dir: Path, cli_env: dict[str, str]
) -> None:
    (config_dir / "mlxppd.toml").write_text("")
    done = run_check(config_dir, cli_env)
    assert done.returncode == 2
    assert "several nodes have addresses of this host ('coordinator', 'stage-0', 'stage-1')" in (
        done.stderr
    )


BAD_EDITS = [
    (
        "cluster.toml",
        ("stage = 1", "stage = 7"),
        "cluster.toml: nodes[2].stage: node 'stage-1' has stage 7",
    ),
    (
        "mlxppd.toml",
        ('node_id = "stage-1"', "nod_id = 1"),
        "mlxppd.toml: nod_id: unknown key 'nod_id'; did you mean 'node_id'? (line 1)",
    ),
    (
        "cluster.toml",
        ('secret_file = "cluster.secret"', 'secret_file = "missing.secret"'),
        "missing.secret",
    ),
]


@pytest.mark.parametrize(("file", "edit", "expected"), BAD_EDITS)
def test_check_names_file_key_and_fix(
    config_dir: Path, cli_env: dict[str, str], file: str, edit: tuple[str, str], expected: str
) -> None:
    path = config_dir / file
    path.write_text(path.read_text().replace(*edit))
    done = run_check(config_dir, cli_env)
    assert done.returncode == 2
    assert done.stdout == ""
    assert expected in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_check_of_a_cluster_toml_without_a_roster_says_how_to_make_one(
    config_dir: Path, cli_env: dict[str, str]
) -> None:
    path = config_dir / "cluster.toml"
    path.write_text(path.read_text().split("\n[roster]\n")[0])
    done = run_check(config_dir, cli_env)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "mlxppctl node-key new" in done.stderr and "[roster]" in done.stderr


def test_check_with_another_nodes_key_names_the_roster(
    config_dir: Path, cli_env: dict[str, str]
) -> None:
    write_agent_key(config_dir, "stage-0")  # stage-1's host holding stage-0's key
    done = run_check(config_dir, cli_env)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "is not node stage-1's key" in done.stderr and "[roster]" in done.stderr


def test_check_without_a_node_key_names_the_file_and_the_command(
    config_dir: Path, cli_env: dict[str, str]
) -> None:
    (config_dir / "node.key").unlink()
    env = {k: v for k, v in cli_env.items() if k != "MLXPP_NODE_KEY_FILE"}
    done = run_check(config_dir, env)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert str(config_dir / "node.key") in done.stderr
    assert "mlxppctl node-key new" in done.stderr


def test_agent_speaks_sd_notify(config_dir: Path, cli_env: dict[str, str], tmp_path: Path) -> None:
    notify = NotifySocket(tmp_path / "notify.sock")
    env = {**cli_env, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"}
    process = subprocess.Popen(
        [MLXPPD, "agent", "--config-dir", str(config_dir)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = notify.wait_for("READY", timeout=240)
        assert "stage 1 serving layers 15-29" in ready["STATUS"]
        first = notify.messages.index(ready)
        # The watchdog pings come from the event loop, every WATCHDOG_USEC / 2.
        notify.wait_for("WATCHDOG", timeout=60, after=first + 1)
        process.send_signal(signal.SIGHUP)
        reloading = notify.wait_for("RELOADING", timeout=30, after=first + 1)
        assert "MONOTONIC_USEC" in reloading
        again = notify.wait_for("READY", timeout=30, after=notify.messages.index(reloading))
        assert "stage 1 serving" in again["STATUS"]
        process.send_signal(signal.SIGTERM)
        stopping = notify.wait_for("STOPPING", timeout=30, after=first + 1)
        assert "draining" in stopping["STATUS"]
        assert process.wait(60) == 0, process.stderr.read() if process.stderr else ""
    finally:
        if process.poll() is None:
            process.kill()
        notify.close()
        if process.stderr:
            process.stderr.close()


def test_check_puts_the_model_cache_in_a_configured_state_dir(
    config_dir: Path, cli_env: dict[str, str], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    (config_dir / "mlxppd.toml").write_text(
        f'node_id = "stage-1"\nstate_dir = "{state}"\nmodel = "embedded"\n'
    )
    env = {k: v for k, v in cli_env.items() if k != "MLXPP_MODEL_CACHE"}
    done = run_check(config_dir, env)
    assert done.returncode == 0, done.stderr
    assert f"model {state / 'models'}" in done.stdout
