"""``mlxppd generate`` with the auto partitioner: balanced by bytes, budgets, --verbose report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.generate_settings import GenerateSettings
from mlxppd.core.layer_ranges import LayerRange, format_pp_layers
from mlxppd.core.partition.plan import balance_layers
from mlxppd.core.profile.model import profile_from_config, read_model_config
from mlxppd.runtime.generate import plan_stages
from tests.support.checkpoint_configs import GEMMA4_E2B
from tests.support.profile_cases import CASES
from tests.support.references import served_weights

MLXPPD = [sys.executable, "-m", "mlxppd.cli.mlxppd_main"]

pytestmark = pytest.mark.slow


def mlxppd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MLXPPD, *args], capture_output=True, text=True, env=env, timeout=600)


def test_pp_size_uses_the_auto_partitioner() -> None:
    profile = profile_from_config(GEMMA4_E2B)
    plan = plan_stages(GenerateSettings(prompt="x", pp_size=2), profile)
    assert plan.auto and plan.ranges == balance_layers(profile, 2).ranges
    single = plan_stages(GenerateSettings(prompt="x"), profile)
    assert single.ranges == (LayerRange(0, 35),)


def test_pp_layers_are_validated_against_adjacency_groups() -> None:
    profile = profile_from_config(GEMMA4_E2B)
    with pytest.raises(Exception, match="separates layer 13 from layer 15"):
        plan_stages(GenerateSettings(prompt="x", pp_layers="0-13,14-34"), profile)


def test_a_family_refused_for_pipelines_is_refused_with_more_than_one_stage() -> None:
    profile = profile_from_config(CASES["kimi_k3-4bit"][0])
    with pytest.raises(Exception, match="kimi_k3 has no pipeline stage executor"):
        plan_stages(GenerateSettings(prompt="x", pp_size=2), profile)
    assert len(plan_stages(GenerateSettings(prompt="x"), profile).stages) == 1


def test_verbose_logs_the_quality_report_with_loaded_bytes(cli_env: dict[str, str]) -> None:
    proc = mlxppd(
        "generate", "--pp-size", "3", "--cpu-weights", "native", "-v", "-n", "2", "--json",
        "-p", "Hi", env=cli_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"]
    err = proc.stderr.splitlines()
    # The tied 8-bit embedding sits on both ends, so the middle stage takes the most blocks.
    assert any("stages 0-4,5-24,25-29 (auto-partitioned by bytes)" in line for line in err)
    at = next(i for i, line in enumerate(err) if line.startswith("pipeline partition quality:"))
    assert err[at].startswith("pipeline partition quality: 3 stages, max=")
    for i, line in enumerate(err[at + 1 : at + 4]):
        assert line.startswith(f"  stage {i} device 'local-stage-{i}' layers=")
        assert " actual=" in line and "actual=unknown" not in line and " drift=" in line


def test_stage_memory_that_cannot_fit_is_one_line_and_exit_2(
    embedded_model_dir: Path, cli_env: dict[str, str]
) -> None:
    proc = mlxppd("generate", "--pp-size", "2", "--stage-memory", "40MiB", "-p", "x", env=cli_env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("mlxppd: error: --stage-memory: the model does not fit")
    assert "short by" in line


def test_stage_memory_shapes_the_plan_and_is_quiet_by_default(
    embedded_model_dir: Path, cli_env: dict[str, str]
) -> None:
    proc = mlxppd(
        "generate",
        "--pp-size",
        "2",
        "--stage-memory",
        "80MiB,50MiB",
        "-n",
        "2",
        "-p",
        "Hi",
        env=cli_env,
    )
    assert proc.returncode == 0, proc.stderr
    profile = profile_from_config(read_model_config(embedded_model_dir))
    plan = balance_layers(profile, 2, [80 * 2**20, 50 * 2**20])
    # Stage 1 (50 MiB) cannot take half of the blocks next to its copy of the tied table.
    assert plan.ranges[1].count < 15
    assert f"stages {format_pp_layers(plan.ranges)} (auto-partitioned by bytes)" in proc.stderr
    # Without -v the quality report stays out of the output.
    assert "pipeline partition quality" not in proc.stderr
    # Float32 weights (~310 MiB a stage) would not fit: auto keeps the 4-bit checkpoint, and
    # says so, rather than refusing budgets the checkpoint fits.
    if served_weights(embedded_model_dir) is CpuWeights.FLOAT32:
        assert "weights: native (auto: float32 weights do not fit --stage-memory)" in proc.stderr


def test_float32_weights_asked_for_must_fit_the_budgets(
    embedded_model_dir: Path, cli_env: dict[str, str]
) -> None:
    flags = ("--pp-size", "2", "--stage-memory", "80MiB,50MiB", "-n", "2", "-p", "Hi")
    proc = mlxppd("generate", *flags, "--cpu-weights", "float32", env=cli_env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("mlxppd: error: --stage-memory: the model does not fit")
    assert "2 stages need at least 621.1 MiB" in line
    assert "--cpu-weights native keeps the checkpoint's own, which may fit" in line
