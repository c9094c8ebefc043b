"""Single-stream decode speed of in-process pipeline generation against mlx-lm, in one run.

    .venv/bin/python bench/generate.py [--model DIR] [--max-tokens 64] [--repeats 3]

Prints a markdown table: decode tokens/s (median of the repeats) for mlx-lm's own
``generate_step`` and for ``--pp-size`` 1, 2 and 3, each with its ratio to mlx-lm. Runs are
interleaved round-robin so a noisy neighbour slows every row alike. Goal: pp-size 2 >= 0.95x.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from mlxppd.core.layer_ranges import even_split
from mlxppd.core.stages import stage_specs
from mlxppd.engine.model_files import read_config, resolve_model_dir
from mlxppd.engine.pipeline import InProcessPipeline
from mlxppd.engine.stage import load_stage
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer

PROMPT = "Tell me a long story about a dragon who learns to play the violin."


def decode_rate(tokens: Iterator[int], max_tokens: int) -> tuple[float, list[int]]:
    """Tokens per second from the first token to the last (prefill excluded)."""
    got: list[int] = []
    start = 0.0
    for token in tokens:
        if not got:
            start = time.perf_counter()
        got.append(token)
    elapsed = time.perf_counter() - start
    assert len(got) == max_tokens, f"expected {max_tokens} tokens, got {len(got)}"
    return (len(got) - 1) / elapsed, got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    model_dir = resolve_model_dir(args.model)
    config = read_config(model_dir)
    n_layers = int(config["num_hidden_layers"])
    prompt = encode_prompt(load_tokenizer(model_dir), PROMPT, chat_template=True)
    reference, _ = load_model(model_dir)

    def mlx_lm_run() -> Iterator[int]:
        for token, _ in generate_step(mx.array(prompt), reference, max_tokens=args.max_tokens):
            yield int(token)

    runners: dict[str, Callable[[], Iterator[int]]] = {"mlx-lm (baseline)": mlx_lm_run}
    for size in (1, 2, 3):
        pipe = InProcessPipeline(
            [load_stage(model_dir, s, config) for s in stage_specs(even_split(n_layers, size))]
        )

        def run(pipe: InProcessPipeline = pipe) -> Iterator[int]:
            return (step.token for step in pipe.generate(prompt, args.max_tokens))

        runners[f"mlxpp --pp-size {size}"] = run

    rates: dict[str, list[float]] = {name: [] for name in runners}
    outputs: dict[str, list[int]] = {}
    for run in runners.values():  # warm-up: compile kernels, touch every weight once
        decode_rate(run(), args.max_tokens)
    for rep in range(args.repeats):
        for name, run in runners.items():
            rate, outputs[name] = decode_rate(run(), args.max_tokens)
            rates[name].append(rate)
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    base = statistics.median(rates["mlx-lm (baseline)"])
    print(
        f"Decode speed, {Path(model_dir).name}, {args.max_tokens} tokens, "
        f"median of {args.repeats} (single stream, one process)\n"
    )
    print("| run | decode tokens/s | ratio to mlx-lm | same tokens as mlx-lm |")
    print("|---|---:|---:|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        same = outputs[name] == outputs["mlx-lm (baseline)"]
        print(f"| {name} | {median:.2f} | {median / base:.3f}x | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
