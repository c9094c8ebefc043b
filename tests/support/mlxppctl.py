"""Running the real ``mlxppctl`` as a subprocess, as an operator does, and reading its answer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO_ROOT

MLXPPCTL = [sys.executable, "-m", "mlxppd.cli.mlxppctl_main"]


def clean_env(tmp_path: Path) -> dict[str, str]:
    """No MLXPP_* settings from the caller; an empty config dir instead of /etc/mlxpp."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXPP_")}
    empty = tmp_path / "empty-config"
    empty.mkdir(exist_ok=True)
    clean["MLXPP_CONFIG_DIR"] = str(empty)
    return clean


def write_secret(path: Path, value: bytes) -> Path:
    path.write_bytes(value + b"\n")
    path.chmod(0o600)
    return path


def mlxppctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MLXPPCTL, *args], capture_output=True, text=True, env=env, timeout=60, cwd=REPO_ROOT
    )


def one_line_error(proc: subprocess.CompletedProcess[str], code: int) -> str:
    """The one ``mlxppctl: error: ...`` line of a command that failed with ``code``."""
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mlxppctl: error: ")
    assert proc.stdout == ""
    return lines[0]
