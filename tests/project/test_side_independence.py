"""The coordinator and the stage are independent sides (pyproject's import-linter contract):
a stage module that imports the coordinator's package fails ``lint-imports``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO_ROOT

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONTRACT = """\
[importlinter]
root_package = mlxppd

[importlinter:contract:sides]
name = the coordinator and the stage are independent sides of one link
type = independence
modules =
    mlxppd.runtime.coordinator
    mlxppd.runtime.stage
"""


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the copy of mlxppd in ``tree``, with the sides' contract."""
    (tree / ".importlinter").write_text(CONTRACT)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(tree / ".importlinter"), "--no-cache"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_sides_are_independent_and_a_stage_importing_the_coordinator_breaks_it(
    tmp_path: Path,
) -> None:
    shutil.copytree(REPO_ROOT / "mlxppd", tmp_path / "mlxppd",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    kept = lint(tmp_path)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "1 kept, 0 broken" in kept.stdout
    (tmp_path / "mlxppd/runtime/stage/reaches_over.py").write_text(
        "from mlxppd.runtime.coordinator.chain import StageChain\n"
    )
    broken = lint(tmp_path)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "mlxppd.runtime.stage.reaches_over -> mlxppd.runtime.coordinator.chain" in broken.stdout
