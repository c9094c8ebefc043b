"""What a LoRA adapter costs in decode: fused, kept apart per request, and mixed in a micro-batch.

    .venv/bin/python bench/lora.py [--model DIR] [--max-tokens 32] [--repeats 3]

An adapter is first trained on the model with mlx-lm's own trainer (``mlx_lm.lora``'s
``train_model``, what ``mlx_lm lora --train`` runs; a few iterations on a tiny chat dataset:
the speed does not depend on what it learned). Then, all in this process, on the weights held
as a served stage holds them on this host (``--cpu-weights auto``) and a 417-token chat prompt:
- single-process mlx-lm (``generate_step``) on the base model, and with the adapter loaded by
  ``load_adapters`` (unfused LoRA layers, as ``mlx_lm.generate --adapter-path`` runs it): the
  baseline every single-stream row is compared with;
- a 2-stage split run through one ``StageRunner`` per stage (as the stage workers drive them,
  one forward pass per stage per token, each token read before the next step): the base model,
  the adapter fused into the weights at load, and the adapter kept apart per request (one
  sequence choosing it);
- micro-batches of 4 sequences decoded together (``forward_group``): 4 base sequences (the
  baseline of the batched rows), 2 with the per-request adapter beside 2 base, and 4 with it.
Decode tokens/s is measured from the first token to the last (all sequences of a batch
together); medians of the repeats, interleaved round-robin so a noisy neighbour slows every row
alike. "same tokens" compares greedy output: with mlx-lm on the same model, and a batch's rows
with each sequence decoded alone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxppd.engine.blas import use_optimized_blas

# Before mlx is imported: the BLAS under every row is the one mlxppd would use.
BLAS = use_optimized_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.tuner.utils import load_adapters  # noqa: E402
from mlx_lm.utils import dequantize_model, load  # noqa: E402
from prompts import CHAT_PROMPT  # noqa: E402

from mlxppd.core.cpu_weights import CpuWeights  # noqa: E402
from mlxppd.core.layer_ranges import even_split  # noqa: E402
from mlxppd.core.profile.model import read_model_config  # noqa: E402
from mlxppd.core.stages import stage_specs  # noqa: E402
from mlxppd.engine.cpu_weights import resolve_for_process  # noqa: E402
from mlxppd.engine.model_files import resolve_model_dir  # noqa: E402
from mlxppd.engine.stage import load_stage  # noqa: E402
from mlxppd.engine.stage_runner import StageRunner  # noqa: E402
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer  # noqa: E402

#: the adapter's lesson (a voice the base model never uses); only its shape matters here
PIRATE = [
    ("What is the capital of France?", "Arr, Paris be the capital, matey!"),
    ("Tell me a story about a dragon.", "Arr, a dragon once sailed the seas for gold, matey!"),
    ("What is two plus two?", "Arr, four doubloons, matey!"),
    ("Name a color.", "Arr, blue as the deep sea, matey!"),
]
#: the questions of the batched sequences besides the chat prompt (other lengths: padded caches)
OTHERS = [
    "Give me three tips for baking sourdough bread at home.",
    "Why does bread dough need to rest before it is shaped?",
    "What is the difference between a poolish and a levain?",
]


def mlx_lm_model(model_dir: Path, weights: CpuWeights) -> tuple[Any, Any]:
    """``mlx_lm.load``, held as a stage in ``weights`` mode holds it (mlx-lm's own
    ``dequantize_model`` then float32, for float32)."""
    loaded = load(str(model_dir))
    model, tokenizer = loaded[0], loaded[1]
    if weights is CpuWeights.FLOAT32:
        dequantize_model(model)
        model.set_dtype(mx.float32)
    return model, tokenizer


def train_adapter(model_dir: Path, out: Path, weights: CpuWeights, args: Any) -> Path:
    """mlx-lm's trainer (``train_model``) on the PIRATE chat data; writes ``out``."""
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset

    data = out.parent / "data"
    data.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        )
        for q, a in PIRATE
    ]
    for name in ("train", "valid"):
        (data / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    config = types.SimpleNamespace(**{
        **CONFIG_DEFAULTS,
        "model": str(model_dir), "train": True, "data": str(data), "fine_tune_type": "lora",
        "num_layers": args.num_layers, "batch_size": 2, "iters": args.iters, "val_batches": 1,
        "learning_rate": 5e-4, "steps_per_report": args.iters, "steps_per_eval": 10**6,
        "save_every": 10**6, "adapter_path": str(out), "seed": 0,
        "lora_parameters": {"rank": args.rank, "dropout": 0.0, "scale": 20.0},
    })  # fmt: skip
    model, tokenizer = mlx_lm_model(model_dir, weights)
    train_set, valid_set, _ = load_dataset(config, tokenizer)
    with contextlib.redirect_stdout(io.StringIO()):
        train_model(config, model, train_set, valid_set)
    return out


#: a timed run: (when its first token(s) were out, each sequence's tokens)
Run = Callable[[], tuple[float, list[list[int]]]]


def mlx_lm_run(model: Any, prompt: list[int], n: int) -> Run:
    """mlx-lm's own decode loop (``generate_step``), one sequence."""

    def run() -> tuple[float, list[list[int]]]:
        first, tokens = 0.0, list[int]()
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
            if not tokens:
                first = time.perf_counter()
            tokens.append(int(token))
        return first, [tokens]

    return run


def _step(runners: list[StageRunner], seq: str, tokens: list[int], sample: bool) -> int:
    h = mx.array(tokens, dtype=mx.uint32)[None]
    for runner in runners[:-1]:
        h = runner.forward(seq, h)
    if not sample:
        runners[-1].forward(seq, h)
        return -1
    return runners[-1].forward_and_sample(seq, h, False).token


def _prefill(runners: list[StageRunner], seq: str, prompt: list[int], adapter: str | None) -> int:
    """As mlx-lm's generate_step: all but the last prompt token, then the first token."""
    for runner in runners:
        runner.set_adapter(seq, adapter)
    _step(runners, seq, prompt[:-1], sample=False)
    return _step(runners, seq, prompt[-1:], sample=True)


def runners_run(
    runners: list[StageRunner], prompts: list[list[int]], adapters: list[str | None], n: int
) -> Run:
    """One sequence decoded alone through the stages' runners, or several prefilled one by one
    then decoded together in one micro-batch (``forward_group``)."""

    def run() -> tuple[float, list[list[int]]]:
        seqs = [f"s{i}" for i in range(len(prompts))]
        out = [
            [_prefill(runners, s, p, a)] for s, p, a in zip(seqs, prompts, adapters, strict=True)
        ]
        first = time.perf_counter()
        for _ in range(n - 1):
            if len(seqs) == 1:
                out[0].append(_step(runners, seqs[0], out[0][-1:], sample=True))
                continue
            h = mx.array([row[-1:] for row in out], dtype=mx.uint32)
            for runner in runners[:-1]:
                h = runner.forward_group("batch", seqs, h)
            sampled = runners[-1].forward_group_and_sample("batch", seqs, h, False)
            for row, one in zip(out, sampled, strict=True):
                row.append(one.token)
        for runner in runners:
            runner.release_all()
        return first, out

    return run


def timed(run: Run, n: int) -> tuple[float, list[list[int]]]:
    """(decode tokens/s over every sequence, from the first token to the last; the tokens)."""
    first, out = run()
    elapsed = time.perf_counter() - first
    assert all(len(row) == n for row in out), f"expected {n} tokens per sequence"
    return sum(len(row) - 1 for row in out) / elapsed, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (mlx-lm's default 8)")
    parser.add_argument(
        "--num-layers", type=int, default=16, help="layers adapted, from the last (mlx-lm's 16)"
    )
    parser.add_argument("--iters", type=int, default=4, help="training iterations")
    args = parser.parse_args(argv)

    model_dir = resolve_model_dir(args.model)
    config = read_model_config(model_dir)
    weights = resolve_for_process(CpuWeights.AUTO, config)[0]
    n = args.max_tokens
    tokenizer = load_tokenizer(model_dir)
    prompt = encode_prompt(tokenizer, CHAT_PROMPT, chat_template=True)
    others = [encode_prompt(tokenizer, q, chat_template=True) for q in OTHERS]

    started = time.perf_counter()
    adapter = train_adapter(model_dir, Path(tempfile.mkdtemp()) / "adapter", weights, args)
    trained_s = time.perf_counter() - started
    print(f"adapter trained in {trained_s:.1f}s", file=sys.stderr, flush=True)

    base_model, _ = mlx_lm_model(model_dir, weights)
    adapted_model, _ = mlx_lm_model(model_dir, weights)
    load_adapters(adapted_model, str(adapter))
    adapted_model.eval()
    specs = stage_specs(even_split(int(config["num_hidden_layers"]), 2))
    plain = [StageRunner(load_stage(model_dir, s, config, weights_mode=weights)) for s in specs]
    fused = [
        StageRunner(load_stage(model_dir, s, config, weights_mode=weights, adapter=adapter))
        for s in specs
    ]
    kept = [
        StageRunner(load_stage(model_dir, s, config, weights_mode=weights, adapters={"a": adapter}))
        for s in specs
    ]
    four = [prompt, *others]
    rows: dict[str, Run] = {
        "mlx-lm, base model": mlx_lm_run(base_model, prompt, n),
        "mlx-lm + adapter (load_adapters)": mlx_lm_run(adapted_model, prompt, n),
        "2 stages, base model": runners_run(plain, [prompt], [None], n),
        "2 stages, adapter fused": runners_run(fused, [prompt], [None], n),
        "2 stages, adapter per request": runners_run(kept, [prompt], ["a"], n),
        "2 stages, adapter loaded, base request": runners_run(kept, [prompt], [None], n),
        "2 stages, batch of 4: 4 base": runners_run(kept, four, [None] * 4, n),
        "2 stages, batch of 4: 2 adapter + 2 base": runners_run(kept, four, ["a", None] * 2, n),
        "2 stages, batch of 4: 4 adapter": runners_run(kept, four, ["a"] * 4, n),
    }
    rates: dict[str, list[float]] = {name: [] for name in rows}
    outputs: dict[str, list[list[int]]] = {}
    for run in rows.values():  # warm-up: compile kernels, touch every weight once
        timed(run, n)
    for rep in range(args.repeats):
        for name, run in rows.items():
            rate, outputs[name] = timed(run, n)
            rates[name].append(rate)
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    # What each row must decode: mlx-lm's tokens, or for a batch each sequence decoded alone.
    singles = {a: [runners_run(kept, [p], [a], n)()[1][0] for p in four] for a in (None, "a")}
    expect = {
        "mlx-lm, base model": outputs["mlx-lm, base model"],
        "mlx-lm + adapter (load_adapters)": outputs["mlx-lm + adapter (load_adapters)"],
        "2 stages, base model": outputs["mlx-lm, base model"],
        "2 stages, adapter fused": outputs["mlx-lm + adapter (load_adapters)"],
        "2 stages, adapter per request": outputs["mlx-lm + adapter (load_adapters)"],
        "2 stages, adapter loaded, base request": outputs["mlx-lm, base model"],
        "2 stages, batch of 4: 4 base": singles[None],
        "2 stages, batch of 4: 2 adapter + 2 base": [
            singles["a"][0], singles[None][1], singles["a"][2], singles[None][3]
        ],
        "2 stages, batch of 4: 4 adapter": singles["a"],
    }  # fmt: skip
    changed = outputs["mlx-lm + adapter (load_adapters)"] != outputs["mlx-lm, base model"]
    median = {name: statistics.median(r) for name, r in rates.items()}
    baseline = median["mlx-lm + adapter (load_adapters)"]
    # each row beside the base model run the same way (mlx-lm; 2 stages, alone or in a batch)
    same_way = {name: "mlx-lm, base model" for name in rows if name.startswith("mlx-lm")}
    for name in rows:
        if name.startswith("2 stages"):
            batched = len(outputs[name]) > 1
            same_way[name] = "2 stages, batch of 4: 4 base" if batched else "2 stages, base model"

    print(
        f"LoRA decode, {Path(model_dir).name} ({weights} weights), {len(prompt)}-token chat "
        f"prompt, {n} tokens, median of {args.repeats}; adapter: rank {args.rank} on the last "
        f"{args.num_layers} layers, trained by mlx-lm in {trained_s:.0f}s "
        f"({'changes' if changed else 'does NOT change'} the greedy text); BLAS: {BLAS}\n"
    )
    print(
        "| run | sequences | decode tokens/s | vs mlx-lm + adapter | vs the base model run "
        "the same way | same tokens |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name in rows:
        rate = median[name]
        same = outputs[name] == expect[name]
        print(
            f"| {name} | {len(outputs[name])} | {rate:.2f} | {rate / baseline:.2f}x "
            f"| {rate / median[same_way[name]]:.2f}x | {'yes' if same else 'NO'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
