"""kimi_k3 runs in one process only: splitting it is refused before anything loads."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.stages import StageSpec
from mlxppd.engine.families import supported_families
from mlxppd.engine.pipeline import InProcessPipeline
from mlxppd.engine.stage import load_stage
from tests.support.family_cases import KIMI_K3


@pytest.fixture(scope="module")
def kimi_dir(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("kimi-k3", KIMI_K3)


def test_kimi_k3_is_not_a_pipeline_family() -> None:
    assert "kimi_k3" not in supported_families()


def test_kimi_k3_generates_in_one_process_like_mlx_lm(kimi_dir: Path) -> None:
    prompt = [(5 * i + 1) % 250 for i in range(30)]
    model, _ = load_model(kimi_dir)
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=16)]
    pipeline = InProcessPipeline([load_stage(kimi_dir, StageSpec(0, 1, 0, 4))])
    assert [s.token for s in pipeline.generate(prompt, 16)] == reference


@pytest.mark.parametrize("flags", [["--pp-size", "2"], ["--pp-layers", "0-1,2-3"]])
def test_kimi_k3_split_is_refused_with_a_clear_error(
    kimi_dir: Path, cli_env: dict[str, str], flags: list[str]
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxppd.cli.mlxppd_main",
            "generate",
            "--model",
            str(kimi_dir),
            *flags,
            "-p",
            "hi",
        ],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "kimi_k3 has no pipeline stage executor" in proc.stderr
    assert "drop --pp-size/--pp-layers" in proc.stderr


def test_kimi_k3_stage_of_two_is_refused_before_loading(kimi_dir: Path) -> None:
    with pytest.raises(ConfigurationError, match="kimi_k3"):
        load_stage(kimi_dir, StageSpec(0, 2, 0, 2))
