"""``mlxppctl plan``: preview how a model splits over pipeline stages (nothing is loaded).

Only config.json is read, so a model can be planned before its weights are downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mlxppd.core.cpu_weights import CpuWeights, held_config, with_native_hint
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import parse_pp_layers
from mlxppd.core.partition.plan import (
    PartitionPlan,
    balance_layers,
    parse_stage_memory,
    plan_layers,
)
from mlxppd.core.partition.quality import format_plan
from mlxppd.core.partition.sizes import format_bytes
from mlxppd.core.partition.tensor_split import rank_bytes
from mlxppd.core.profile.model import profile_from_config, read_model_config

_EPILOG = """\
examples:
  mlxppctl plan --model ./Mixtral-8x7B-4bit --pp-size 3
  mlxppctl plan --model ./gemma-4-e2b-it-4bit/config.json --pp-size 2 --stage-memory 8GiB,4GiB
  mlxppctl plan --model ./llama-60b --pp-layers 0-19,20-39,40-59 --json

Sizes: GiB / MiB (and G / M) are binary, GB / MB decimal; a plain number is bytes.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="preview a model's split over pipeline stages",
        description=(
            "Estimate every layer's parameter bytes from config.json, split the layers over "
            "--pp-size stages (balanced by bytes, within --stage-memory budgets, never "
            "separating layers that share a KV cache) or check a --pp-layers split, and print "
            "each stage's layers, estimated memory and fit. Nothing is loaded."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-m",
        "--model",
        metavar="DIR|config.json",
        help="mlx-lm model directory or its config.json (default: the embedded model)",
    )
    p.add_argument("--pp-size", type=int, metavar="N", help="number of pipeline stages")
    p.add_argument(
        "--pp-layers",
        metavar="RANGES",
        help='inclusive layer range per stage, e.g. "0-14,15-29" (checked, not balanced)',
    )
    p.add_argument(
        "--stage-memory",
        metavar="SIZES",
        help="memory budget per stage, e.g. 64GiB,16GiB (one size: every stage)",
    )
    p.add_argument(
        "--cpu-weights",
        type=CpuWeights,
        choices=list(CpuWeights),
        default=CpuWeights.NATIVE,
        metavar="{native,float32}",
        help="price the weights as the stages hold them: native (as stored, default) or "
        "float32 (a CPU host's fast path: quantized weights materialized in float32)",
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        metavar="T",
        help="tensor-parallel ranks per stage: also show what one rank of each stage holds "
        "(its blocks split over T by mlx-lm's shard(); the embedding and head whole), and "
        "refuse a model that cannot be split that way",
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=run)


def _model_config(model: str | None) -> tuple[dict[str, Any], str]:
    if model is None:
        # Only the default needs the engine (it converts the embedded GGUF once).
        from mlxppd.engine.model_files import resolve_model_dir

        path = resolve_model_dir(None, progress=lambda m: print(m, file=sys.stderr, flush=True))
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise ConfigurationError(
                f"{model} does not exist; give a model directory or its config.json "
                "(plan never downloads a model)",
                source="--model",
            )
    return read_model_config(path), str(path)


def plan_for(args: argparse.Namespace, config: dict[str, Any]) -> PartitionPlan:
    """The plan the flags ask for (pure: config in, plan out)."""
    weights = getattr(args, "cpu_weights", CpuWeights.NATIVE)
    if weights is CpuWeights.AUTO:
        raise ConfigurationError(
            "auto depends on the host that loads the stage; plan native or float32",
            source="--cpu-weights",
        )
    profile = profile_from_config(held_config(config, weights))
    if args.pp_layers is None and args.pp_size is None:
        raise ConfigurationError("give --pp-size N (or --pp-layers) to plan", source="--pp-size")
    if args.pp_layers is not None:
        ranges = parse_pp_layers(args.pp_layers, profile.num_layers, profile.adjacency_groups)
        if args.pp_size is not None and args.pp_size != len(ranges):
            raise ConfigurationError(
                f"{args.pp_size} stages asked but --pp-layers lists {len(ranges)} ranges; "
                "drop --pp-size or make them agree",
                source="--pp-size",
            )
        budgets = parse_stage_memory(args.stage_memory, len(ranges)) if args.stage_memory else None
        return plan_layers(profile, ranges, budgets)
    num_stages = args.pp_size
    if num_stages < 1:
        raise ConfigurationError(
            f"{num_stages} stages requested; use --pp-size 1 or more", source="--pp-size"
        )
    budgets = parse_stage_memory(args.stage_memory, num_stages) if args.stage_memory else None
    try:
        return balance_layers(profile, num_stages, budgets)
    except ConfigurationError as exc:
        raise with_native_hint(exc, weights) from None


def run(args: argparse.Namespace) -> int:
    config, label = _model_config(args.model)
    plan = plan_for(args, config)
    tp = args.tp_size
    if tp < 1:
        raise ConfigurationError(f"{tp} ranks per stage; use 1 or more", source="--tp-size")
    if tp > 1:
        from mlxppd.engine.tensor_parallel import tp_refusal

        refusal = tp_refusal(config, tp)
        if refusal is not None:
            raise ConfigurationError(refusal, source="--tp-size")
    per_rank = rank_bytes(plan, tp)
    if args.json:
        document = plan.to_json()
        if tp > 1:
            document |= {"tp_size": tp, "rank_bytes": list(per_rank)}
        print(json.dumps(document, indent=2))
        return 0
    print(format_plan(plan, label))
    if tp > 1:
        print(f"\ntensor-parallel: {tp} ranks per stage; each rank holds")
        for stage, nbytes in zip(plan.stages, per_rank, strict=True):
            print(
                f"  stage {stage.stage_index}: {format_bytes(nbytes)} "
                f"(of {format_bytes(stage.estimated_memory_bytes)})"
            )
    return 0
