"""Token parity: greedy decoding through any split equals single-process mlx-lm, token for token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.layer_ranges import even_split, parse_pp_layers
from mlxppd.core.stages import stage_specs
from mlxppd.engine.pipeline import InProcessPipeline
from mlxppd.engine.stage import load_stage
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer
from tests.conftest import TINY_LLAMA
from tests.support.references import reference_tokens

MAX_TOKENS = 40


def pipeline_tokens(
    model_dir: Path,
    ranges: Any,
    prompt: list[int],
    n: int = MAX_TOKENS,
    weights: CpuWeights = CpuWeights.NATIVE,
) -> list[int]:
    stages = [load_stage(model_dir, s, weights_mode=weights) for s in stage_specs(ranges)]
    assert all(stage.weights is weights for stage in stages)
    return [step.token for step in InProcessPipeline(stages).generate(prompt, n)]


@pytest.fixture(scope="module", params=[CpuWeights.NATIVE, CpuWeights.FLOAT32], ids=str)
def embedded_case(
    embedded_model_dir: Path, request: pytest.FixtureRequest
) -> tuple[CpuWeights, list[int], list[int]]:
    """The 4-bit checkpoint as stored, and materialized in float32 (the CPU fast path)."""
    weights = request.param
    tokenizer = load_tokenizer(embedded_model_dir)
    prompt = encode_prompt(tokenizer, "Tell me a story about a dragon.", chat_template=True)
    reference = reference_tokens(embedded_model_dir, prompt, MAX_TOKENS, weights)
    # A meaningful comparison needs a long, varied continuation with no early stop.
    assert len(reference) == MAX_TOKENS and len(set(reference)) > 15
    return weights, prompt, reference


# Three-way splits: the uneven one here; an even one in test_serve_cluster (three stages).
@pytest.mark.parametrize("split", ["pp-size 2", "0-0,1-28,29-29"])
def test_embedded_model_split_matches_mlx_lm(
    embedded_model_dir: Path, embedded_case: tuple[CpuWeights, list[int], list[int]], split: str
) -> None:
    weights, prompt, reference = embedded_case
    if split.startswith("pp-size"):
        ranges = even_split(30, int(split.split()[1]))
    else:
        ranges = parse_pp_layers(split, 30)
    assert pipeline_tokens(embedded_model_dir, ranges, prompt, weights=weights) == reference


TINY_VARIANTS: dict[str, tuple[dict[str, Any], int | None]] = {
    "llama-untied-fp32": (TINY_LLAMA, None),
    "llama-tied-4bit": ({**TINY_LLAMA, "tie_word_embeddings": True}, 4),
    "mistral-8bit": ({**TINY_LLAMA, "model_type": "mistral"}, 8),
    # Sliding-window layers pick their mask and cache by global layer index.
    "llama-sliding": (
        {
            **TINY_LLAMA,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 3,
        },
        None,
    ),
}


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
@pytest.mark.parametrize("layers", ["0-2,3-5", "0-0,1-4,5-5", "0-1,2-3,4-5"])
def test_tiny_llama_split_matches_mlx_lm(
    tiny_model: Callable[..., Path], variant: str, layers: str
) -> None:
    config, bits = TINY_VARIANTS[variant]
    model_dir = tiny_model(variant, config, quantize_bits=bits)
    # Longer than the sliding window, so the rotating caches wrap during prefill and decode.
    prompt = [(7 * i + 3) % 256 for i in range(20)]
    reference = reference_tokens(model_dir, prompt, 24)
    assert len(set(reference)) > 3, "random weights gave a degenerate continuation"
    assert pipeline_tokens(model_dir, parse_pp_layers(layers, 6), prompt, 24) == reference
