"""Planning speed of the auto partitioner on a 1,000-layer MoE model over 8 stages.

    .venv/bin/python bench/partition.py [--layers 1000] [--stages 8] [--repeats 7]

Prints a markdown table: median planning time of ``balance_layers`` (no budgets, heterogeneous
budgets, adjacency groups), of building the profile from config.json, and of two baselines run
in the same process: the even split by layer count (what ``--pp-size`` did before) and the
textbook O(stages x layers^2) dynamic program, whose optimum the balancer must match. Goal: every
``balance_layers`` row under 100 ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from mlxppd.core.layer_ranges import AdjacencyGroup, LayerRange, even_split
from mlxppd.core.partition.plan import balance_layers, format_bytes
from mlxppd.core.profile.model import ModelProfile, profile_from_config

GOAL_MS = 100.0


def moe_config(layers: int) -> dict[str, Any]:
    """A DeepSeek V3-shaped model (MLA, 256 routed experts, 3 dense blocks) of ``layers`` blocks."""
    return {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": layers,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "torch_dtype": "bfloat16",
        "quantization": {"group_size": 64, "bits": 4},
    }


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median milliseconds of ``repeats`` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), result


def loads(profile: ModelProfile, ranges: tuple[LayerRange, ...]) -> list[int]:
    last = len(ranges) - 1
    return [profile.stage_bytes(r, first=i == 0, last=i == last) for i, r in enumerate(ranges)]


def textbook_dp(profile: ModelProfile, stages: int) -> int:
    """min over splits of the largest stage load, by the O(k n^2) recurrence (no constraints)."""
    n, w = profile.num_layers, profile.layer_bytes
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[j]: smallest max load covering layers [0, j) with the stages so far
    best: list[float] = [inf] * (n + 1)
    for j in range(1, n + 1):
        best[j] = profile.embedding_bytes + prefix[j]
    for k in range(1, stages):
        extra = profile.lm_head_bytes if k == stages - 1 else 0
        new: list[float] = [inf] * (n + 1)
        for j in range(k + 1, n + 1):
            pj = prefix[j] + extra
            new[j] = min(max(best[i], pj - prefix[i]) for i in range(k, j))
        best = new
    return int(best[n])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    n, k, reps = args.layers, args.stages, args.repeats

    config = moe_config(n)
    profile_ms, profile = timed(lambda: profile_from_config(config), reps)
    total = profile.total_bytes
    # Heterogeneous hosts: the last two stages have half the memory of an even share.
    even_share = total // k
    budgets = [2 * even_share] * (k - 2) + [even_share // 2] * 2
    # Adjacency groups: every 10th block shares state with the next 4 (a synthetic stand-in for
    # Gemma 4's KV sharing at this scale).
    grouped = dataclasses.replace(
        profile, adjacency_groups=tuple(AdjacencyGroup(i, i + 4) for i in range(0, n - 4, 10))
    )

    rows: list[tuple[str, float, int, float, bool]] = []

    def auto(label: str, prof: ModelProfile, caps: list[int | None] | None) -> int:
        ms, plan = timed(lambda: balance_layers(prof, k, caps), reps)
        rows.append((label, ms, plan.max_bytes, plan.imbalance, ms < GOAL_MS))
        return plan.max_bytes

    best = auto("balance_layers, no budgets", profile, None)
    auto("balance_layers, heterogeneous budgets", profile, list(budgets))
    auto("balance_layers, adjacency groups", grouped, None)

    ms, ranges = timed(lambda: even_split(n, k), reps)
    even = loads(profile, ranges)
    rows.append(("baseline: even split by layer count", ms, max(even), max(even) / min(even), True))
    dp_ms, dp_best = timed(lambda: textbook_dp(profile, k), 1)
    rows.append(("baseline: textbook O(k n^2) DP", dp_ms, dp_best, float("nan"), True))

    print(f"### Planning a {n}-layer MoE profile ({format_bytes(total)}) over {k} stages\n")
    print(f"profile from config.json: {profile_ms:.1f} ms (median of {reps})\n")
    print("| planner | time (ms) | largest stage | imbalance | under 100 ms |")
    print("|---|---:|---:|---:|:---:|")
    for label, ms, largest, imbalance, ok in rows:
        ratio = "-" if imbalance != imbalance else f"{imbalance:.3f}x"
        goal = ("yes" if ok else "**no**") if label.startswith("balance") else "-"
        print(f"| {label} | {ms:.1f} | {format_bytes(largest)} | {ratio} | {goal} |")
    if dp_best != best:
        print(f"\nMISMATCH: balance_layers found {best}, the DP {dp_best}", file=sys.stderr)
        return 1
    print(f"\nbalance_layers and the DP agree on the optimum ({best} bytes).")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
