"""Single-process mlx-lm references that hold their weights as the served stages do.

Parity is always against mlx-lm running the same weights: where the product's default
(``cpu_weights = auto``) materializes float32 on this host, the reference is mlx-lm's own
``dequantize_model`` then ``set_dtype(float32)``; elsewhere it is the checkpoint as stored.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.profile.model import read_model_config
from mlxppd.engine.cpu_weights import resolve_for_process


def served_weights(model_dir: Path, mode: CpuWeights = CpuWeights.AUTO) -> CpuWeights:
    """The weight mode ``mode`` resolves to for this model on this host."""
    return resolve_for_process(mode, read_model_config(model_dir))[0]


def held_as(model: Any, weights: CpuWeights) -> Any:
    """mlx-lm's model converted the way a stage in ``weights`` mode holds it (in place)."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    if weights is CpuWeights.FLOAT32:
        dequantize_model(model)
        model.set_dtype(mx.float32)
    return model


def load_reference(model_dir: Path, mode: CpuWeights = CpuWeights.AUTO) -> tuple[Any, Any]:
    """``mlx_lm.load`` of ``model_dir``, holding its weights as a served stage does."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    return held_as(model, served_weights(model_dir, mode)), tokenizer


def load_reference_model(model_dir: Path, mode: CpuWeights = CpuWeights.AUTO) -> Any:
    """``mlx_lm.utils.load_model`` of ``model_dir``, held as a served stage does."""
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    return held_as(model, served_weights(model_dir, mode))


def reference_tokens(
    model_dir: Path, prompt: list[int], n: int, weights: CpuWeights = CpuWeights.NATIVE
) -> list[int]:
    """Single-process mlx-lm's first ``n`` greedy tokens after ``prompt``, the weights held as
    a stage in ``weights`` mode holds them."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model = load_reference_model(model_dir, weights)
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def greedy_answers(model_dir: Path, asks: Iterable[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """Single-process mlx-lm's greedy answer to each (question, max_tokens), asked as a one-turn
    chat, with the weights held as a served stage holds them."""
    model, tokenizer = load_reference(model_dir)
    return answers_of(model, tokenizer, asks)


def answers_of(
    model: Any, tokenizer: Any, asks: Iterable[tuple[str, int]]
) -> dict[tuple[str, int], str]:
    """``model``'s greedy answer to each (question, max_tokens), asked as a one-turn chat."""
    from mlx_lm import generate

    out = {}
    for question, max_tokens in asks:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        out[(question, max_tokens)] = str(generate(model, tokenizer, prompt, max_tokens=max_tokens))
    return out


def copy_of(model_dir: Path, held: Any) -> Any:
    """A new mlx-lm model of ``model_dir`` holding ``held``'s (already converted) arrays, for
    references that change the module tree (``load_adapters``) without converting the
    checkpoint again (about 3 s of CPU for the embedded model)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir, lazy=True)
    held_as(model, served_weights(model_dir))
    model.update(held.parameters())
    return model
