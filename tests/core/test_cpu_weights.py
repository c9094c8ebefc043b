"""Float32 weights on CPU hosts: when ``auto`` takes them, their cost, how a stage holds them."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlxppd.core.agent.plan import ReloadStage, SetGeneration, plan
from mlxppd.core.cpu_weights import (
    ComputeHost,
    CpuWeights,
    float32_config,
    held_config,
    resolve_cpu_weights,
)
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.profile.model import profile_from_config, read_model_config
from mlxppd.core.stages import StageSpec
from mlxppd.engine.stage import load_stage
from tests.support.agent_states import STAGE, running, stage_node
from tests.support.cluster_toml import cluster_toml, load_text, refused

CPU_FAST = ComputeHost(cpu_only=True, optimized_blas=True, available_bytes=16 << 30)
GIB = 1 << 30


@pytest.mark.parametrize(
    ("host", "float32_bytes", "expected", "why"),
    [
        (CPU_FAST, GIB, CpuWeights.FLOAT32, "optimized BLAS"),
        (replace(CPU_FAST, cpu_only=False), GIB, CpuWeights.NATIVE, "accelerator"),
        (replace(CPU_FAST, optimized_blas=False), GIB, CpuWeights.NATIVE, "no optimized BLAS"),
        # 60% of the available memory may go to weights; the rest is KV and activations.
        (CPU_FAST, 9 * GIB, CpuWeights.FLOAT32, "optimized BLAS"),
        (CPU_FAST, 10 * GIB, CpuWeights.NATIVE, "float32 weights need 10737418240 bytes"),
        (replace(CPU_FAST, available_bytes=None), 100 * GIB, CpuWeights.FLOAT32, "BLAS"),
    ],
)
def test_auto_takes_float32_only_on_a_fast_cpu_host_with_room(
    host: ComputeHost, float32_bytes: int, expected: CpuWeights, why: str
) -> None:
    mode, reason = resolve_cpu_weights(CpuWeights.AUTO, host, float32_bytes)
    assert mode is expected
    assert why in reason


@pytest.mark.parametrize("mode", [CpuWeights.NATIVE, CpuWeights.FLOAT32])
def test_an_explicit_mode_is_kept_whatever_the_host(mode: CpuWeights) -> None:
    slow = ComputeHost(cpu_only=False, optimized_blas=False, available_bytes=1)
    assert resolve_cpu_weights(mode, slow, 100 * GIB) == (mode, f"{mode} (asked for)")


def test_the_float32_config_prices_every_tensor_at_four_bytes(embedded_model_dir: Path) -> None:
    config = read_model_config(embedded_model_dir)
    native = profile_from_config(config)
    f32 = profile_from_config(float32_config(config))
    assert "quantization" in config and "quantization" not in float32_config(config)
    assert f32.storage == "unquantized (32-bit floats)"
    assert f32.total_bytes == 4 * 134_515_008  # SmolLM2-135M's parameter count
    assert f32.total_bytes > 5 * native.total_bytes  # 4-bit layers, an 8-bit embedding table
    assert held_config(config, CpuWeights.NATIVE) is config
    with pytest.raises(ValueError):
        held_config(config, CpuWeights.AUTO)


def test_a_float32_stage_holds_only_float32_matrices_priced_exactly(
    embedded_model_dir: Path,
) -> None:
    config = read_model_config(embedded_model_dir)
    spec = StageSpec(1, 2, 15, 30)
    stage = load_stage(embedded_model_dir, spec, config, weights_mode=CpuWeights.FLOAT32)
    assert stage.weights is CpuWeights.FLOAT32
    params = dict(tree_flatten(stage.net.model.parameters()))
    assert params and all(v.dtype == mx.float32 for v in params.values())
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in stage.net.model.named_modules())
    assert not any(name.endswith(".scales") for name in params)
    profile = profile_from_config(float32_config(config))
    assert stage.parameter_bytes == profile.stage_bytes(LayerRange(15, 30), first=False, last=True)


def test_a_float32_repartition_keeps_the_layers_it_retains(embedded_model_dir: Path) -> None:
    config = read_model_config(embedded_model_dir)
    f32 = CpuWeights.FLOAT32
    before = load_stage(embedded_model_dir, StageSpec(1, 2, 15, 30), config, weights_mode=f32)
    after = load_stage(
        embedded_model_dir, StageSpec(1, 2, 10, 30), config, reuse=before, weights_mode=f32
    )
    per_layer = 9  # q k v o gate up down + two norms, all plain float32 tensors
    assert after.loaded_tensors == 5 * per_layer
    assert after.reused_tensors == 15 * per_layer + 2  # and the final norm and the tied head
    x = mx.array([[1, 2, 3]])
    fresh = load_stage(embedded_model_dir, StageSpec(0, 2, 0, 10), config, weights_mode=f32)
    hidden = fresh(x, fresh.make_cache())
    fresh_out = load_stage(embedded_model_dir, StageSpec(1, 2, 10, 30), config, weights_mode=f32)
    assert mx.array_equal(
        after(hidden, after.make_cache()), fresh_out(hidden, fresh_out.make_cache())
    )


def test_the_cluster_toml_takes_cpu_weights_and_names_a_bad_value(tmp_path: Path) -> None:
    assert load_text(tmp_path, cluster_toml()).cluster.cpu_weights is CpuWeights.AUTO
    native = load_text(tmp_path, cluster_toml({"cpu_weights": "native"}))
    assert native.cluster.cpu_weights == "native"
    refused(tmp_path, cluster_toml({"cpu_weights": "fast"}), "cluster.cpu_weights", "float32")


def test_a_new_weight_mode_reloads_the_stage() -> None:
    want = replace(STAGE, cpu_weights=CpuWeights.NATIVE)
    actions = plan(stage_node(want, gen="g2"), running(stage=STAGE))
    assert list(actions) == [ReloadStage(want), SetGeneration("g2")]


def test_a_bad_cpu_weights_flag_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "generate", "-p", "hi",
         "--cpu-weights", "fast"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--cpu-weights" in proc.stderr and "'fast'" in proc.stderr and "float32" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plan_prices_float32_and_refuses_auto(embedded_model_dir: Path) -> None:
    def plan_cli(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mlxppd.cli.mlxppctl_main", "plan", "-m",
             str(embedded_model_dir), "--pp-size", "2", *flags],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    native, f32 = plan_cli(), plan_cli("--cpu-weights", "float32")
    assert native.returncode == 0 and f32.returncode == 0, native.stderr + f32.stderr
    assert "4-bit affine" in native.stdout and "62.0 MiB" in native.stdout
    assert "unquantized (32-bit floats)" in f32.stdout and "310.6 MiB" in f32.stdout
    short = plan_cli("--cpu-weights", "float32", "--stage-memory", "100MiB")
    assert short.returncode == 2
    assert "--cpu-weights native keeps the checkpoint's own, which may fit" in short.stderr
    assert "may fit" not in plan_cli("--stage-memory", "10MiB").stderr
    auto = plan_cli("--cpu-weights", "auto")
    assert auto.returncode != 0 and "--cpu-weights" in auto.stderr


def test_config_error_names_the_source() -> None:
    from mlxppd.core.cpu_weights import parse_cpu_weights

    with pytest.raises(ConfigurationError, match="--cpu-weights"):
        parse_cpu_weights("bf16")


def _host(tmp: Path, meminfo: str | None, cgroup: str, limit: str | None, used: int) -> Path:
    """A /proc and /sys/fs/cgroup as a unit sees them; returns the fake root."""
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    if meminfo is not None:
        (proc / "meminfo").write_text(meminfo)
    (proc / "self" / "cgroup").write_text(f"0::{cgroup}\n")
    group = tmp / "cgroup" / cgroup.lstrip("/")
    group.mkdir(parents=True)
    if limit is not None:
        (group / "memory.max").write_text(f"{limit}\n")
        (group / "memory.current").write_text(f"{used}\n")
    return tmp


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc and cgroup v2 files")
def test_free_memory_comes_from_meminfo_capped_by_the_units_memory_max(tmp_path: Path) -> None:
    from mlxppd.engine.cpu_weights import available_memory_bytes

    gib = 1 << 30
    meminfo = "MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n"
    root = _host(tmp_path / "a", meminfo, "/system.slice/mlxppd.service", "max", 0)
    assert available_memory_bytes(root / "proc", root / "cgroup") == 16 * gib
    root = _host(tmp_path / "b", meminfo, "/system.slice/mlxppd.service", str(6 * gib), gib)
    assert available_memory_bytes(root / "proc", root / "cgroup") == 5 * gib
    # ProcSubset=pid hides /proc/meminfo: the free pages stand in, still under memory.max.
    root = _host(tmp_path / "c", None, "/system.slice/mlxppd.service", str(2 * gib), 0)
    hidden = available_memory_bytes(root / "proc", root / "cgroup")
    assert hidden is not None and 0 < hidden <= 2 * gib
    root = _host(tmp_path / "d", None, "/", None, 0)
    assert available_memory_bytes(root / "proc", root / "cgroup") is not None
