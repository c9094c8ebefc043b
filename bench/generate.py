"""Prefill and decode speed of in-process pipeline generation against mlx-lm, in one run.

    .venv/bin/python bench/generate.py [--model DIR] [--max-tokens 64] [--repeats 3]

Prints a markdown table: prefill tokens/s of a 417-token chat prompt and single-stream decode
tokens/s (medians of the repeats) for mlx-lm's own ``generate_step`` and for ``--pp-size`` 1
and 2, with the weights as the checkpoint stores them (native, e.g. 4-bit) and materialized in
float32 (``--cpu-weights float32``, the Linux CPU fast path), each on the BLAS this process put
under mlx (named in the header; ``MLXPP_BLAS=bundled`` measures the wheel's reference BLAS).
Ratios are to mlx-lm on the native weights; "same tokens" compares with mlx-lm on the same
weights. Runs are interleaved round-robin so a noisy neighbour slows every row alike.
Goal: pp-size 2 decode >= 0.95x mlx-lm on the same weights.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mlxppd.engine.blas import use_optimized_blas

# Before mlx is imported: the BLAS under every row is the one mlxppd would use.
BLAS = use_optimized_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.utils import dequantize_model, load_model  # noqa: E402
from prompts import CHAT_PROMPT  # noqa: E402

from mlxppd.core.cpu_weights import CpuWeights  # noqa: E402
from mlxppd.core.layer_ranges import even_split  # noqa: E402
from mlxppd.core.profile.model import read_model_config  # noqa: E402
from mlxppd.core.stages import stage_specs  # noqa: E402
from mlxppd.engine.model_files import resolve_model_dir  # noqa: E402
from mlxppd.engine.pipeline import InProcessPipeline  # noqa: E402
from mlxppd.engine.stage import load_stage  # noqa: E402
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer  # noqa: E402


def timed(tokens: Iterator[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """(seconds to the first token, decode tokens/s after it, the tokens)."""
    got: list[int] = []
    start = time.perf_counter()
    first = 0.0
    for token in tokens:
        if not got:
            first = time.perf_counter()
        got.append(token)
    elapsed = time.perf_counter() - first
    assert len(got) == max_tokens, f"expected {max_tokens} tokens, got {len(got)}"
    return first - start, (len(got) - 1) / elapsed, got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--pp-sizes", default="1,2", help="comma-separated --pp-size values (default 1,2)"
    )
    args = parser.parse_args(argv)

    model_dir = resolve_model_dir(args.model)
    config = read_model_config(model_dir)
    n_layers = int(config["num_hidden_layers"])
    prompt = encode_prompt(load_tokenizer(model_dir), CHAT_PROMPT, chat_template=True)
    n = args.max_tokens
    runners: dict[str, Callable[[], Iterator[int]]] = {}
    same_weights: dict[str, str] = {}
    for weights in (CpuWeights.NATIVE, CpuWeights.FLOAT32):
        reference, _ = load_model(model_dir)
        if weights is CpuWeights.FLOAT32:
            dequantize_model(reference)
            reference.set_dtype(mx.float32)

        def mlx_lm_run(model: object = reference) -> Iterator[int]:
            for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
                yield int(token)

        base = f"mlx-lm, {weights} weights"
        runners[base] = mlx_lm_run
        same_weights[base] = base
        for size in (int(s) for s in args.pp_sizes.split(",")):
            specs = stage_specs(even_split(n_layers, size))
            pipe = InProcessPipeline(
                [load_stage(model_dir, s, config, weights_mode=weights) for s in specs]
            )

            def run(pipe: InProcessPipeline = pipe) -> Iterator[int]:
                return (step.token for step in pipe.generate(prompt, n))

            name = f"mlxpp --pp-size {size}, {weights} weights"
            runners[name] = run
            same_weights[name] = base

    first: dict[str, list[float]] = {name: [] for name in runners}
    rates: dict[str, list[float]] = {name: [] for name in runners}
    outputs: dict[str, list[int]] = {}
    for run in runners.values():  # warm-up: compile kernels, touch every weight once
        timed(run(), n)
    for rep in range(args.repeats):
        for name, run in runners.items():
            ttft, rate, outputs[name] = timed(run(), n)
            first[name].append(ttft)
            rates[name].append(rate)
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    base_name = "mlx-lm, native weights"
    base_prefill = len(prompt) / statistics.median(first[base_name])
    base_decode = statistics.median(rates[base_name])
    print(
        f"Prefill and decode, {Path(model_dir).name}, {len(prompt)}-token prompt, {n} tokens, "
        f"median of {args.repeats} (single stream, one process); BLAS: {BLAS}\n"
    )
    print(
        "| run | prefill tokens/s | vs mlx-lm native | decode tokens/s | vs mlx-lm native "
        "| same tokens as mlx-lm on the same weights |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name in runners:
        prefill = len(prompt) / statistics.median(first[name])
        decode = statistics.median(rates[name])
        same = outputs[name] == outputs[same_weights[name]]
        print(
            f"| {name} | {prefill:.1f} | {prefill / base_prefill:.2f}x | {decode:.2f} "
            f"| {decode / base_decode:.2f}x | {'yes' if same else 'NO'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
