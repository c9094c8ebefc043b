"""``mlxppd serve`` flags: bad values are one-line errors before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest


def serve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--pp-micro-batch-size", "x"], "--pp-micro-batch-size: 'x' is not a size"),
        (["--pp-micro-batch-size", "0"], "--pp-micro-batch-size: '0' is not a size"),
        (["--parallel", "0"], "--parallel: must be at least 1"),
        (["--max-batch-size", "0"], "--max-batch-size: must be at least 1"),
        (["--pp-layers", "0-10,12-29"], "layer 11"),
        (["--metrics"], "--metrics, --metrics-port and --debug-pp-trace need a pipeline"),
        (["--distributed-config", "etc/mlxpp/cluster.toml"], "--node-id is required"),
        (
            ["--distributed-config", "etc/mlxpp/cluster.toml", "--node-id", "x", "--pp-size", "2"],
            "drop --pp-size/--pp-layers",
        ),
    ],
)
def test_bad_serve_flags_are_one_line_errors(
    cli_env: dict[str, str], flags: list[str], expected: str, embedded_model_dir: object
) -> None:
    proc = serve(*flags, env=cli_env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("mlxppd: error: ")
    assert expected in lines[-1]


def test_serve_help_explains_the_roles(cli_env: dict[str, str]) -> None:
    proc = serve("--help", env=cli_env)
    assert proc.returncode == 0
    for text in ("--pp-size", "--distributed-config", "--kv-budget-bytes", "--once", "roles:"):
        assert text in proc.stdout


def test_the_log_level_reaches_the_stage_processes(cli_env: dict[str, str]) -> None:
    """--log-level WARNING quiets the whole local cluster, not only the coordinator."""
    flags = ("--pp-size", "2", "--port", "0", "--max-tokens", "4", "--once", "Hi")
    quiet = serve(*flags, "--log-level", "WARNING", env=cli_env)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip()
    assert " INFO " not in quiet.stderr, quiet.stderr
    chatty = serve(*flags, env=cli_env)
    assert chatty.returncode == 0, chatty.stderr
    assert "mlxppd.stage INFO stage 0: layers 0-14" in chatty.stderr
