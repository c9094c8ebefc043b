"""A repartitioned stage reads only the layers it gains; the rest it keeps from before."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from mlxppd.core.profile.model import read_model_config
from mlxppd.core.stages import StageSpec
from mlxppd.engine.stage import load_stage


def test_growing_stage_reads_only_the_gained_layers(embedded_model_dir: Path) -> None:
    config = read_model_config(embedded_model_dir)
    before = load_stage(embedded_model_dir, StageSpec(1, 2, 15, 30), config)
    assert before.reused_tensors == 0
    after = load_stage(embedded_model_dir, StageSpec(1, 2, 10, 30), config, reuse=before)
    fresh = load_stage(embedded_model_dir, StageSpec(1, 2, 10, 30), config)
    per_layer = (fresh.loaded_tensors - before.loaded_tensors) // 5
    assert per_layer > 0
    # Layers 10-14 are read; layers 15-29, the final norm and the head are taken over.
    assert after.loaded_tensors == 5 * per_layer
    assert after.reused_tensors == before.loaded_tensors
    assert after.parameter_bytes == fresh.parameter_bytes
    x = mx.random.normal((1, 4, int(config["hidden_size"]))).astype(mx.float16)
    got = after(x, after.make_cache())
    want = fresh(x, fresh.make_cache())
    assert mx.array_equal(got, want).item()


def test_shrinking_stage_reads_nothing(embedded_model_dir: Path) -> None:
    config = read_model_config(embedded_model_dir)
    before = load_stage(embedded_model_dir, StageSpec(0, 2, 0, 15), config)
    after = load_stage(embedded_model_dir, StageSpec(0, 2, 0, 10), config, reuse=before)
    assert after.loaded_tensors == 0
    assert after.reused_tensors > 0
    assert after.parameter_bytes < before.parameter_bytes
