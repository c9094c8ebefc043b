"""Decode speed with tensor-parallel stages (2D PP x TP) against mlx-lm, in one run.

    .venv/bin/python bench/tensor_parallel.py [--model DIR] [--max-tokens 48]

Without --model it builds a llama that splits over 2 ranks (8 heads, 4 KV heads, hidden 512,
8 layers, the embedded model's tokenizer and vocabulary; random weights: speed does not depend
on them) in a temporary directory. Prints two markdown tables:
- single-stream greedy decode tokens/s of ``mlxppd generate`` (every stage in one process per
  rank; ranks on loopback) for pp=2,tp=1, pp=2,tp=2 and pp=1,tp=2 beside mlx-lm's own
  ``generate_step`` in this process, and of a served local cluster (``serve --pp-size 2``,
  ``--tp-size`` 1 and 2: real stage processes) beside ``mlx_lm.server``; ratios to mlx-lm and
  whether the tokens equal it;
- the weight bytes each (stage, rank) slot of the served 2x2 cluster (blocks split evenly
  between the stages) holds, from ``mlxppctl status``: in all, and of the model's blocks.
On one 2-core host the ranks share the cores and their all_sum goes over loopback: tensor
parallelism is for a stage that does not fit one host, not for speed here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline import chat, start_cluster, start_mlx_lm_server
from serve import stop

from mlxppd.engine.blas import use_optimized_blas

BLAS = use_optimized_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from mlxppd.engine.embedded import default_cache_dir, ensure_embedded_model  # noqa: E402
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."
BENCH_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def build_model(where: Path) -> Path:
    """A random-weight llama made by mlx-lm's own model class, with the embedded tokenizer."""
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    mx.random.seed(0)
    model_class, args_class = _get_classes(BENCH_LLAMA)
    model = model_class(args_class.from_dict(BENCH_LLAMA))
    model.update(tree_map(lambda p: p * 4 if p.ndim >= 2 else p, model.parameters()))
    where.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(where / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (where / "config.json").write_text(json.dumps(BENCH_LLAMA, indent=2))
    embedded = ensure_embedded_model(default_cache_dir())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(embedded / name, where / name)
    return where


def mlx_lm_decode(model_dir: Path, max_tokens: int) -> tuple[float, list[int]]:
    import time

    model, _ = load_model(model_dir)
    model.set_dtype(mx.float32)  # as the stages hold it on a CPU host (auto: float32)
    prompt = encode_prompt(load_tokenizer(model_dir), PROMPT, chat_template=True)
    tokens, first = [], 0.0
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if not tokens:
            first = time.perf_counter()
        tokens.append(int(token))
    return (len(tokens) - 1) / (time.perf_counter() - first), tokens


def generate_row(model_dir: Path, pp: int, tp: int, n: int, env: dict[str, str]) -> Any:
    """``mlxppd generate``'s decode tokens/s, its tokens, and rank 0's shard bytes per stage."""
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "generate", "--model", str(model_dir),
           "--pp-size", str(pp), "--tp-size", str(tp), "-n", str(n), "--temp", "0", "--json",
           "-p", PROMPT]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    speed = float(re.findall(r"decode ([0-9.]+) tokens/s", done.stderr)[-1])
    tokens = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    return speed, tokens["tokens"]


def halves(model_dir: Path) -> str:
    """``--pp-layers`` splitting the blocks evenly: the canonical 2x2, a quarter per rank."""
    layers = int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])
    return f"0-{layers // 2 - 1},{layers // 2}-{layers - 1}"


def serve_row(model_dir: Path, tp: int, n: int, env: dict[str, str], tmp: Path) -> Any:
    secret = tmp / f"secret-{tp}"
    subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppctl_main", "secret", "new", str(secret)],
        check=True, capture_output=True, env=env,
    )  # fmt: skip
    proc, base = start_cluster(
        model_dir, 2, env, None, "--pp-layers", halves(model_dir), "--tp-size", str(tp),
        "--cluster-secret-file", str(secret),
    )  # fmt: skip
    try:
        chat(base, "m", "Hello", 4)  # warm
        run = chat(base, "m", PROMPT, n)
        status = subprocess.run(
            [sys.executable, "-m", "mlxppd.cli.mlxppctl_main", "status", "--json", "--url", base,
             "--cluster-secret-file", str(secret)],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        stages = json.loads(status.stdout)["stages"]
    finally:
        stop(proc)
    return run.decode_tps, run.text, stages


def layer_bytes(model_dir: Path) -> dict[int, int]:
    """Bytes of each transformer block's weights as float32 (the stages' CPU default)."""
    out: dict[int, int] = {}
    for path in model_dir.glob("*.safetensors"):
        for name, array in mx.load(str(path)).items():
            found = re.search(r"\.layers\.(\d+)\.", name)
            if found is not None:
                out[int(found[1])] = out.get(int(found[1]), 0) + array.size * 4
    return out


def print_memory(model_dir: Path, whole: list[Any], split: list[Any]) -> None:
    """Each (stage, rank) slot's bytes: all it holds, and its share of the model's blocks."""
    blocks = layer_bytes(model_dir)
    model_bytes = sum(s["parameter_bytes"] for s in whole)
    print("\n| slot (serve pp=2,tp=2) | weight bytes held | share of the model | block "
          "weights held | share of the model's blocks |")  # fmt: skip
    print("|---|---|---|---|---|")
    for unsharded, stage in zip(whole, split, strict=True):
        first, last = (int(v) for v in str(stage["layers"]).split("-"))
        own_blocks = sum(blocks[i] for i in range(first, last + 1))
        others = unsharded["parameter_bytes"] - own_blocks  # embedding, head, norms: whole
        for slot in stage["slots"]:
            held = slot["parameter_bytes"]
            print(
                f"| stage {stage['stage']} rank {slot['rank']} | {held / 1e6:.1f} MB | "
                f"{held / model_bytes:.2f} | {(held - others) / 1e6:.1f} MB | "
                f"{(held - others) / sum(blocks.values()):.2f} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: a built llama)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    env = dict(os.environ)
    env.pop("OPENBLAS_NUM_THREADS", None)  # each process as it runs by itself
    try:
        model_dir = Path(args.model) if args.model else build_model(tmp / "llama")
        n = args.max_tokens
        print(f"model {model_dir}, BLAS {BLAS}, {os.cpu_count()} cores, {n} tokens", flush=True)
        base_tps, base_tokens = mlx_lm_decode(model_dir, n)
        rows = [("mlx-lm generate_step (1 process)", base_tps, True)]
        for pp, tp in ((2, 1), (2, 2), (1, 2)):
            tps, tokens = generate_row(model_dir, pp, tp, n, env)
            # generate stops at an end-of-sequence token; mlx-lm's generate_step does not.
            same = tokens == base_tokens[: len(tokens)]
            rows.append((f"mlxppd generate pp={pp},tp={tp}", tps, same))
            print(f"  {rows[-1]}", flush=True)
        server, server_base = start_mlx_lm_server(model_dir, env)
        try:
            chat(server_base, str(model_dir), "Hello", 4)
            reference = chat(server_base, str(model_dir), PROMPT, n)
        finally:
            stop(server)
        served = [("mlx_lm.server (1 process)", reference.decode_tps, True)]
        stages: dict[int, Any] = {}
        for tp in (1, 2):
            tps, text, stages[tp] = serve_row(model_dir, tp, n, env, tmp)
            served.append((f"serve pp=2,tp={tp}", tps, text == reference.text))
            print(f"  {served[-1]}", flush=True)
        print("\n| decode, single stream | tokens/s | vs mlx-lm | same tokens |")
        print("|---|---|---|---|")
        for name, tps, same in rows:
            print(f"| {name} | {tps:.1f} | {tps / base_tps:.2f}x | {'yes' if same else 'NO'} |")
        for name, tps, same in served:
            ratio = tps / reference.decode_tps
            print(f"| {name} | {tps:.1f} | {ratio:.2f}x | {'yes' if same else 'NO'} |")
        print_memory(model_dir, stages[1], stages[2])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
