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

#: long enough to tell a wrong split from a right one (a varied continuation, no early stop)
MAX_TOKENS = 16


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


@pytest.fixture(scope="module")
def embedded_reference(
    embedded_model_dir: Path,
) -> Callable[[CpuWeights], tuple[list[int], list[int]]]:
    """The prompt and mlx-lm's greedy tokens after it, the weights held as a stage in that mode
    holds them (the 4-bit checkpoint as stored, or float32: the CPU fast path), once a mode."""
    tokenizer = load_tokenizer(embedded_model_dir)
    prompt = encode_prompt(tokenizer, "Tell me a story about a dragon.", chat_template=True)
    done: dict[CpuWeights, list[int]] = {}

    def get(weights: CpuWeights) -> tuple[list[int], list[int]]:
        if weights not in done:
            done[weights] = reference_tokens(embedded_model_dir, prompt, MAX_TOKENS, weights)
        reference = done[weights]
        # A meaningful comparison needs a varied continuation with no early stop.
        assert len(reference) == MAX_TOKENS and len(set(reference)) > MAX_TOKENS // 2
        return prompt, reference

    return get


# Three-way splits: the uneven one here; an even one in test_serve_cluster (three stages).
# The even two-way split in float32 (the served default) is every two-stage cluster's parity
# (test_generate_cli, test_serve_cluster); here it runs on the checkpoint as stored.
@pytest.mark.parametrize(
    ("weights", "split"),
    [
        (CpuWeights.NATIVE, "pp-size 2"),
        (CpuWeights.NATIVE, "0-0,1-28,29-29"),
        (CpuWeights.FLOAT32, "0-0,1-28,29-29"),
    ],
    ids=str,
)
def test_embedded_model_split_matches_mlx_lm(
    embedded_model_dir: Path,
    embedded_reference: Callable[[CpuWeights], tuple[list[int], list[int]]],
    weights: CpuWeights,
    split: str,
) -> None:
    prompt, reference = embedded_reference(weights)
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


#: longer than the sliding window, so the rotating caches wrap during prefill and decode
TINY_PROMPT = [(7 * i + 3) % 256 for i in range(20)]


@pytest.fixture(scope="module")
def tiny_reference(tiny_model: Callable[..., Path]) -> Callable[[str], tuple[Path, list[int]]]:
    """A variant's model and mlx-lm's 24 greedy tokens on it, computed once per variant."""
    done: dict[str, tuple[Path, list[int]]] = {}

    def get(variant: str) -> tuple[Path, list[int]]:
        if variant not in done:
            config, bits = TINY_VARIANTS[variant]
            model_dir = tiny_model(variant, config, quantize_bits=bits)
            done[variant] = (model_dir, reference_tokens(model_dir, TINY_PROMPT, 24))
        return done[variant]

    return get


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
@pytest.mark.parametrize("layers", ["0-2,3-5", "0-0,1-4,5-5", "0-1,2-3,4-5"])
def test_tiny_llama_split_matches_mlx_lm(
    tiny_reference: Callable[[str], tuple[Path, list[int]]], variant: str, layers: str
) -> None:
    model_dir, reference = tiny_reference(variant)
    prompt = TINY_PROMPT
    assert len(set(reference)) > 3, "random weights gave a degenerate continuation"
    assert pipeline_tokens(model_dir, parse_pp_layers(layers, 6), prompt, 24) == reference
