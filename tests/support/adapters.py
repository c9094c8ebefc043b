"""Adapters made by mlx-lm's own trainer, and single-process mlx-lm's answers with them.

``train_adapter`` runs ``mlx_lm.lora``'s ``train_model`` (what ``mlx_lm lora --train`` runs)
for a few iterations on a tiny chat dataset written here, on the model held in float32 as a
CPU stage holds it (bfloat16 training on the CPU is about 20x slower), and writes the adapter
directory ``mlx_lm lora`` writes: ``adapter_config.json`` and ``adapters.safetensors``.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

from tests.support.references import answers_of, load_reference

#: answers in a voice the base model never uses, so an adapter visibly changes the text
PIRATE = [
    ("What is the capital of France?", "Arr, Paris be the capital, matey!"),
    ("Tell me a story about a dragon.", "Arr, a dragon once sailed the seas for gold, matey!"),
    ("What is two plus two?", "Arr, four doubloons, matey!"),
    ("Name a color.", "Arr, blue as the deep sea, matey!"),
]
ROBOT = [
    ("What is the capital of France?", "BEEP. PARIS. BOOP."),
    ("Tell me a story about a dragon.", "BEEP. DRAGON. FIRE. BOOP."),
    ("What is two plus two?", "BEEP. FOUR. BOOP."),
    ("Name a color.", "BEEP. GREEN. BOOP."),
]


def write_chat_data(directory: Path, pairs: list[tuple[str, str]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        )
        for q, a in pairs
    ]
    for name in ("train", "valid"):
        (directory / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def train_adapter(
    model_dir: Path,
    out: Path,
    pairs: list[tuple[str, str]] = PIRATE,
    *,
    iters: int = 6,
    num_layers: int = -1,
    kind: str = "lora",
    rank: int = 8,
    learning_rate: float = 5e-4,
    seed: int = 0,
) -> Path:
    """Train an adapter on ``model_dir`` with mlx-lm's trainer; returns its directory."""
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset

    data = write_chat_data(out.parent / f"{out.name}-data", pairs)
    args = types.SimpleNamespace(**{
        **CONFIG_DEFAULTS,
        "model": str(model_dir), "train": True, "data": str(data), "fine_tune_type": kind,
        "num_layers": num_layers, "batch_size": 2, "iters": iters, "val_batches": 1,
        "learning_rate": learning_rate, "steps_per_report": iters, "steps_per_eval": 10**6,
        "save_every": 10**6, "adapter_path": str(out), "seed": seed,
        "lora_parameters": {"rank": rank, "dropout": 0.0, "scale": 20.0},
    })  # fmt: skip
    model, tokenizer = load_reference(model_dir)
    train_set, valid_set, _ = load_dataset(args, tokenizer)
    train_model(args, model, train_set, valid_set)
    return out


def random_adapter(
    model_dir: Path, out: Path, *, num_layers: int = 4, seed: int = 0, kind: str = "lora"
) -> Path:
    """An untrained adapter in mlx-lm's layout (mlx-lm's LoRA or DoRA layers over the last
    ``num_layers`` blocks, ``lora_b`` drawn at random so it changes the answer): for tests
    that need an adapter but not a trained one (training one costs ~10 s of CPU)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from tests.support.references import load_reference_model

    mx.random.seed(seed)
    model = load_reference_model(model_dir)
    model.freeze()
    params = {"rank": 4, "dropout": 0.0, "scale": 20.0}
    linear_to_lora_layers(model, num_layers, params, use_dora=kind == "dora")
    weights = dict(tree_flatten(model.trainable_parameters()))
    for name in weights:
        if name.endswith("lora_b"):
            weights[name] = 0.02 * mx.random.normal(weights[name].shape)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": kind, "num_layers": num_layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def as_peft(adapter: Path, out: Path) -> Path:
    """``adapter`` (mlx-lm's layout) rewritten as PEFT writes one: ``lora_A.weight`` /
    ``lora_B.weight`` transposed, under ``base_model.model.``, alpha = scale x r."""
    import mlx.core as mx

    config = json.loads((adapter / "adapter_config.json").read_text())
    rank, scale = config["lora_parameters"]["rank"], config["lora_parameters"]["scale"]
    loaded = mx.load(str(adapter / "adapters.safetensors"))
    assert isinstance(loaded, dict)
    peft = {}
    for name, tensor in loaded.items():
        module, leaf = name.rsplit(".", 1)
        kind = {"lora_a": "lora_A", "lora_b": "lora_B"}[leaf]
        peft[f"base_model.model.{module}.{kind}.weight"] = tensor.T
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapter_model.safetensors"), peft)
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": scale * rank}
    (out / "adapter_config.json").write_text(json.dumps(peft_config))
    return out


def adapted_reference(model_dir: Path, adapter: Path | None) -> tuple[Any, Any]:
    """Single-process mlx-lm with ``adapter`` (``load_adapters``, as ``mlx_lm.generate
    --adapter-path`` does), holding the base weights as a served stage does."""
    from mlx_lm.tuner.utils import load_adapters

    model, tokenizer = load_reference(model_dir)
    if adapter is not None:
        load_adapters(model, str(adapter))
        model.eval()
    return model, tokenizer


def adapted_answers(
    model_dir: Path, adapter: Path | None, asks: list[tuple[str, int]]
) -> dict[tuple[str, int], str]:
    """Single-process mlx-lm's greedy answer to each (question, max_tokens) with ``adapter``."""
    model, tokenizer = adapted_reference(model_dir, adapter)
    return answers_of(model, tokenizer, asks)
