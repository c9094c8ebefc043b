"""``mlxppd serve`` flags: bad values are one-line errors before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def serve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--pp-size", "2", "--pp-micro-batch-size", "x"],
            "--pp-micro-batch-size: 'x' is not a size",
        ),
        (
            ["--pp-size", "2", "--pp-micro-batch-size", "0"],
            "--pp-micro-batch-size: '0' is not a size",
        ),
        (["--pp-size", "2", "--parallel", "0"], "--parallel: must be at least 1"),
        (["--max-batch-size", "0"], "--max-batch-size: must be at least 1"),
        (["--pp-layers", "0-10,12-29"], "layer 11"),
        (["--pp-size", "1"], "--pp-size: a local cluster needs at least 2 stages"),
        (["--pp-layers", "0-29"], "--pp-layers: '0-29' is one stage"),
        (
            ["--metrics"],
            "--metrics has no effect on serving every stage in this process (no --pp-size or "
            "--distributed-config): it needs a pipeline; add --pp-size 2 (or more) or "
            "--distributed-config; drop --metrics",
        ),
        (["--distributed-config", "etc/mlxpp/cluster.toml"], "--node-id is required"),
        (
            ["--distributed-config", "etc/mlxpp/cluster.toml", "--node-id", "x"],
            "--node-id: no node 'x' in etc/mlxpp/cluster.toml; use one of coordinator, stage-0",
        ),
        (
            ["--distributed-config", "etc/mlxpp/cluster.toml", "--node-id", "stage-0",
             "--pp-size", "2"],
            "the cluster TOML fixes the stages; drop --pp-size",
        ),
        (
            ["--distributed-config", "etc/mlxpp/cluster.toml", "--node-id", "stage-0",
             "--port", "9000"],
            "--port has no effect on a pipeline stage node of --distributed-config: a stage "
            "serves no HTTP and holds no requests",
        ),
        (["--max-tokens", "5"], "--max-tokens has no effect on serving every stage in this "
         "process (no --pp-size or --distributed-config): it sizes the --once answer; add --once "
         "PROMPT, or drop --max-tokens"),
        (["--api-key", "k", "--api-key-file", "k.txt"], "--api-key: --api-key and --api-key-file"),
    ],
)  # fmt: skip
def test_bad_serve_flags_are_one_line_errors(
    cli_env: dict[str, str], flags: list[str], expected: str, embedded_model_dir: object
) -> None:
    proc = serve(*flags, env=cli_env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("mlxppd: error: ")
    assert expected in lines[-1]


def test_a_loose_api_key_file_is_refused_naming_the_file_and_the_fix(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    key = tmp_path / "api.key"
    key.write_text("sk-local-0123456789\n")
    key.chmod(0o644)
    proc = serve("--api-key-file", str(key), env=cli_env)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert f"the API key file {key} named by --api-key-file" in line
    assert f"chmod 600 {key}" in line and "sk-local" not in proc.stderr


def test_serve_help_explains_the_roles(cli_env: dict[str, str]) -> None:
    proc = serve("--help", env=cli_env)
    assert proc.returncode == 0
    for text in ("--pp-size", "--distributed-config", "--kv-budget-bytes", "--once", "roles:"):
        assert text in proc.stdout


def test_the_log_level_reaches_the_stage_processes(cli_env: dict[str, str]) -> None:
    """--log-level WARNING quiets the whole local cluster, not only the coordinator."""
    flags = ("--pp-size", "2", "--port", "0", "--max-tokens", "2", "--once", "Hi")
    quiet = serve(*flags, "--log-level", "WARNING", env=cli_env)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip()
    assert " INFO " not in quiet.stderr, quiet.stderr
    chatty = serve(*flags, env=cli_env)
    assert chatty.returncode == 0, chatty.stderr
    # (a local cluster splits by time per token: 0-16 + 17-29 on the embedded model)
    assert "mlxppd.stage INFO stage 0: layers 0-16" in chatty.stderr


@pytest.mark.slow
def test_the_api_key_file_guards_the_openai_api(cli_env: dict[str, str], tmp_path: Path) -> None:
    """--api-key-file: the key stays off the command line and still guards /v1."""
    import time
    import urllib.error
    import urllib.request

    key = tmp_path / "api.key"
    key.write_text("sk-from-a-file-0123456789\n")
    key.chmod(0o600)
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--port", "0",
         "--api-key-file", str(key), "--ready-file", str(ready)],
        env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        url = ready.read_text().strip() + "/v1/models"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=30)
        assert refused.value.code == 401
        request = urllib.request.Request(
            url, headers={"Authorization": "Bearer sk-from-a-file-0123456789"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        assert "sk-from-a-file" not in str(proc.args)
    finally:
        proc.terminate()
        proc.wait(60)
