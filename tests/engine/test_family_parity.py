"""The parity matrix: for every family, mlx-lm single process == 2 stages == 3 stages.

Greedy decoding of 24 tokens after a prompt longer than any sliding window, token for token,
plus the last step's logits allclose; and each stage holds only its own layers' parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.layer_ranges import parse_pp_layers
from mlxppd.core.stages import stage_specs
from mlxppd.engine.families import family_for, supported_families, wire_family
from mlxppd.engine.families.base import layer_index
from mlxppd.engine.pipeline import InProcessPipeline
from mlxppd.engine.stage import LoadedStage, load_stage
from tests.support.all_families import ALL_CASES, PROMPT
from tests.support.references import held_as

N_TOKENS = 24


def _params(stage: LoadedStage) -> dict[str, int]:
    flat = tree_flatten(stage.net.model.parameters())
    return {name: value.nbytes for name, value in flat}


def _reference(model_dir: Path) -> tuple[list[int], mx.array, dict[str, int]]:
    model, _ = load_model(model_dir)
    tokens = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS)]
    logits = model(mx.array(PROMPT + tokens[:-1])[None])[0, -1]
    sizes = {name: v.nbytes for name, v in tree_flatten(model.parameters())}
    return tokens, logits, sizes


@pytest.mark.parametrize("family", sorted(ALL_CASES))
def test_family_parity_matrix(tiny_model: Callable[..., Path], family: str) -> None:
    config, bits, splits = ALL_CASES[family]
    model_dir = tiny_model(f"family-{family}", config, quantize_bits=bits)
    ref_tokens, ref_logits, ref_sizes = _reference(model_dir)
    assert len(set(ref_tokens)) > 3, "random weights gave a degenerate continuation"
    n_layers = family_for(config).num_layers(config)
    ref_layer_bytes = sum(v for k, v in ref_sizes.items() if layer_index(k) is not None)

    for split in splits:
        stages = [load_stage(model_dir, s) for s in stage_specs(parse_pp_layers(split, n_layers))]
        pipeline = InProcessPipeline(stages)
        tokens = [step.token for step in pipeline.generate(PROMPT, N_TOKENS)]
        assert tokens == ref_tokens, f"{family} split {split} diverged"
        logits = pipeline.forward(mx.array(PROMPT + tokens[:-1])[None], pipeline.make_caches())
        assert mx.allclose(logits[0, -1], ref_logits, atol=1e-4, rtol=1e-4).item()

        # Each stage holds only tensors of its own layers (plus its end of the model).
        layer_bytes = 0
        for stage in stages:
            for name, nbytes in _params(stage).items():
                index = layer_index(name)
                if index is None:
                    continue
                assert stage.spec.owns_layer(index), f"stage {stage.spec.index} holds {name}"
                layer_bytes += nbytes
            assert stage.parameter_bytes == sum(_params(stage).values())
        assert layer_bytes == ref_layer_bytes, "the stages' layers do not add up to the model's"


QUANTIZED_CASES = sorted(name for name, (_, bits, _) in ALL_CASES.items() if bits is not None)


@pytest.mark.parametrize("family", QUANTIZED_CASES)
def test_family_float32_weights_match_mlx_lm_dequantized(
    tiny_model: Callable[..., Path], family: str
) -> None:
    """The CPU fast path: a quantized checkpoint materialized in float32 at load, per stage,
    decodes like mlx-lm's own ``dequantize_model`` + ``set_dtype(float32)`` of the whole model."""
    config, bits, splits = ALL_CASES[family]
    model_dir = tiny_model(f"family-{family}", config, quantize_bits=bits)
    reference = held_as(load_model(model_dir)[0], CpuWeights.FLOAT32)
    ref_tokens = [
        int(t) for t, _ in generate_step(mx.array(PROMPT), reference, max_tokens=N_TOKENS)
    ]
    n_layers = family_for(config).num_layers(config)
    specs = stage_specs(parse_pp_layers(splits[0], n_layers))
    stages = [load_stage(model_dir, s, weights_mode=CpuWeights.FLOAT32) for s in specs]
    for stage in stages:
        dtypes = {v.dtype for _, v in tree_flatten(stage.net.model.parameters())}
        assert mx.float32 in dtypes and not dtypes & {mx.float16, mx.bfloat16, mx.uint32}, dtypes
    tokens = [step.token for step in InProcessPipeline(stages).generate(PROMPT, N_TOKENS)]
    assert tokens == ref_tokens, f"{family} split {splits[0]} diverged in float32"


def test_every_wire_family_has_a_case() -> None:
    covered = {wire_family(config) for config, _, _ in ALL_CASES.values()}
    assert covered == set(supported_families())


def test_case_names_are_model_types() -> None:
    for name, (config, _, _) in ALL_CASES.items():
        assert isinstance(config.get("model_type"), str), name
