"""Split rules of the recurrent / Gemma 4 families: what a stage boundary may and may not cut."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import parse_pp_layers
from mlxppd.core.stages import stage_specs
from mlxppd.engine.families import family_for, wire_family
from mlxppd.engine.families.gemma4 import kv_sources
from mlxppd.engine.stage import load_stage
from tests.support.family_cases_boundaries import CASES

# gemma-4-e2b's shape: 35 blocks, the last 20 KV-shared, four sliding blocks then one full;
# so 15..34 read the K/V of 13 (sliding) or 14 (full).
E2B = {
    "model_type": "gemma4_text",
    "num_hidden_layers": 35,
    "num_kv_shared_layers": 20,
    "sliding_window_pattern": 5,
}


def _check(config: dict[str, object], split: str) -> None:
    family = family_for(config)
    for spec in stage_specs(parse_pp_layers(split, family.num_layers(config))):
        family.check_split(config, spec)


def test_gemma4_kv_sources_follow_mlx_lm() -> None:
    types = ["s", "s", "f", "s", "s", "f"]
    assert kv_sources(types, 2) == {4: 3, 5: 2}
    assert kv_sources(types, 0) == {}


@pytest.mark.parametrize(
    ("split", "pair"),
    [
        ("0-13,14-34", (13, 15)),  # the sliding source 13 left behind
        ("0-14,15-34", (13, 15)),  # both sources left behind: the first consumer is named
        ("0-12,13-20,21-34", (13, 21)),  # consumers of one source split up
    ],
)
def test_gemma4_refuses_a_boundary_inside_a_kv_sharing_group(
    split: str, pair: tuple[int, int]
) -> None:
    source, consumer = pair
    with pytest.raises(ConfigurationError) as info:
        _check(E2B, split)
    message = str(info.value)
    assert f"layers {source} and {consumer} share a KV cache" in message
    assert f"layer {consumer} reads layer {source}'s keys and values" in message
    assert "same stage" in message


@pytest.mark.parametrize("split", ["0-12,13-34", "0-5,6-12,13-34", "0-34"])
def test_gemma4_accepts_a_boundary_before_the_kv_sharing_group(split: str) -> None:
    _check(E2B, split)


def test_gemma4_stage_load_refuses_the_split(tiny_model: Callable[..., Path]) -> None:
    config, bits, _ = CASES["gemma4_text"]
    model_dir = tiny_model("rules-gemma4", config, quantize_bits=bits)
    stages = stage_specs(parse_pp_layers("0-4,5-7", 8))
    with pytest.raises(ConfigurationError, match="layers 4 and 7 share a KV cache"):
        load_stage(model_dir, stages[1])
    with pytest.raises(ConfigurationError, match="layers 4 and 7 share a KV cache"):
        load_stage(model_dir, stages[0])
    # Right at the group's edge is fine: 4..7 stay together.
    for spec in stage_specs(parse_pp_layers("0-3,4-7", 8)):
        load_stage(model_dir, spec)


@pytest.mark.parametrize("family", ["jamba", "nemotron_h", "qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_recurrent_families_accept_every_block_boundary(family: str) -> None:
    # SSM state lives inside a block, so any boundary between two blocks is a valid split.
    config = CASES[family][0]
    n = family_for(config).num_layers(config)
    for cut in range(n - 1):
        _check(config, f"0-{cut},{cut + 1}-{n - 1}")


@pytest.mark.parametrize(
    ("model_type", "wire"),
    [
        ("gemma4_text", "gemma4"),
        ("gemma4", "gemma4_vlm"),
        ("jamba", "jamba"),
        ("nemotron_h", "nemotron_h"),
        ("qwen3_next", "qwen3_next"),
        ("qwen3_5", "qwen3_5"),
        ("qwen3_5_moe", "qwen3_5_moe"),
    ],
)
def test_wire_names(model_type: str, wire: str) -> None:
    assert wire_family({"model_type": model_type}) == wire
