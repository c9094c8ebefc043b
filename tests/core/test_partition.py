"""The layer partitioner (mlxppd.core.partition.plan): optimal, budget-aware, adjacency-aware."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations, pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import AdjacencyGroup, LayerRange
from mlxppd.core.partition.plan import (
    balance_compute,
    balance_layers,
    format_bytes,
    parse_byte_size,
    parse_stage_memory,
    plan_from_pp_layers,
    plan_layers,
)
from mlxppd.core.profile.model import ModelProfile, profile_from_config
from tests.support.checkpoint_configs import GEMMA4_E2B, LLAMA_8B_4BIT
from tests.support.synthetic_profiles import synthetic

GiB = 2**30


def brute_force(
    profile: ModelProfile, num_stages: int, budgets: Sequence[int | None]
) -> tuple[int, int] | None:
    """(smallest possible largest load, then largest possible smallest load) over every split."""
    n, best = profile.num_layers, None
    for cuts in combinations(range(1, n), num_stages - 1):
        if any(g.is_cut_by(c) for c in cuts for g in profile.adjacency_groups):
            continue
        bounds = (0, *cuts, n)
        loads = [
            profile.stage_bytes(LayerRange(a, b), first=i == 0, last=i == num_stages - 1)
            for i, (a, b) in enumerate(pairwise(bounds))
        ]
        if any(b is not None and load > b for load, b in zip(loads, budgets, strict=True)):
            continue
        key = (max(loads), -min(loads))
        best = key if best is None else min(best, key)
    return None if best is None else (best[0], -best[1])


@st.composite
def balancing_tasks(draw: st.DrawFn) -> tuple[ModelProfile, int, list[int | None]]:
    n = draw(st.integers(1, 10))
    weights = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    embedding, lm_head = draw(st.integers(0, 120)), draw(st.integers(0, 120))
    shared = draw(st.integers(0, min(embedding, lm_head)))
    groups = []
    if n >= 2:
        for _ in range(draw(st.integers(0, 3))):
            first = draw(st.integers(0, n - 2))
            groups.append(AdjacencyGroup(first, draw(st.integers(first + 1, n - 1))))
    k = draw(st.integers(1, min(4, n)))
    budgets = draw(st.lists(st.none() | st.integers(0, 400), min_size=k, max_size=k))
    return synthetic(weights, embedding, lm_head, shared, groups), k, budgets


# -- optimality ------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(balancing_tasks())
def test_plan_is_optimal_against_brute_force(
    task: tuple[ModelProfile, int, list[int | None]],
) -> None:
    profile, k, budgets = task
    expected = brute_force(profile, k, budgets)
    if expected is None:
        with pytest.raises(ConfigurationError):
            balance_layers(profile, k, budgets)
        return
    plan = balance_layers(profile, k, budgets)
    # No split has a lighter heaviest stage, and among those none has a heavier lightest one.
    assert (plan.max_bytes, plan.min_bytes) == expected
    # The plan is a valid one: contiguous, every layer once, no group cut, within budgets.
    ranges = plan.ranges
    assert ranges[0].start == 0 and ranges[-1].end == profile.num_layers
    assert all(a.end == b.start for a, b in pairwise(ranges))
    assert not any(g.is_cut_by(r.start) for r in ranges for g in profile.adjacency_groups)
    for stage, budget in zip(plan.stages, budgets, strict=True):
        assert budget is None or stage.estimated_memory_bytes <= budget
        assert stage.budget_bytes == budget


def test_stage_zero_carries_the_embedding_and_the_last_stage_the_head() -> None:
    # 8 equal blocks; the embedding weighs 3 blocks, the head 1: stage 0 takes 2 blocks fewer.
    plan = balance_layers(synthetic([10] * 8, embedding=30, lm_head=10), 2)
    assert plan.ranges == (LayerRange(0, 3), LayerRange(3, 8))
    assert [s.estimated_memory_bytes for s in plan.stages] == [60, 60]
    assert plan.stages[0].has_embedding and not plan.stages[0].has_lm_head
    assert plan.stages[1].has_lm_head and not plan.stages[1].has_embedding


def test_a_single_stage_holds_a_tied_table_once() -> None:
    profile = synthetic([10] * 4, embedding=100, lm_head=105, shared=100)
    (stage,) = balance_layers(profile, 1).stages
    assert stage.estimated_memory_bytes == 40 + 100 + 5 == profile.total_bytes


def test_ties_give_earlier_stages_the_extra_layer() -> None:
    assert balance_layers(synthetic([1] * 7), 3).ranges == (
        LayerRange(0, 3),
        LayerRange(3, 5),
        LayerRange(5, 7),
    )


def test_moe_blocks_are_spread_by_bytes_not_by_count() -> None:
    # Dense blocks 1, MoE blocks 10 (every other block): an even layer count would be uneven.
    weights = [1, 10] * 6
    plan = balance_layers(synthetic(weights), 3)
    assert plan.max_bytes == 22 and plan.imbalance == pytest.approx(1.0)


# -- heterogeneous budgets -------------------------------------------------------------------


def test_a_memory_constrained_stage_gets_fewer_layers() -> None:
    profile = profile_from_config(LLAMA_8B_4BIT)
    even = balance_layers(profile, 2)
    assert [r.count for r in even.ranges] == [16, 16]
    budgets = [16 * GiB, 1 * GiB]
    tight = balance_layers(profile, 2, budgets)
    assert tight.stages[1].layer_range.count < 16
    assert tight.stages[1].estimated_memory_bytes <= 1 * GiB
    # The spill goes to the roomy stage, and no other split does better under these budgets.
    assert tight.stages[0].layer_range.count > 16
    assert (tight.max_bytes, tight.min_bytes) == brute_force(profile, 2, budgets)
    # Beyond 1.5x the plan says why it is uneven.
    assert tight.imbalance > 1.5
    assert any("The stage memory budgets force it" in w for w in tight.warnings)


def test_budgets_that_cannot_be_met_name_the_short_stage_and_the_fix() -> None:
    profile = synthetic([10] * 6, embedding=30, lm_head=5)
    with pytest.raises(ConfigurationError) as info:
        balance_layers(profile, 2, [35, 100])
    message = str(info.value)
    assert message.startswith("--stage-memory: the model does not fit the stage memory budgets")
    # Stage 0 must hold the 30-byte embedding plus at least one 10-byte block: 5 bytes short.
    assert "stage 0 short by 5 B (5 bytes" in message
    assert "for the embedding and layer 0 and has 35 B" in message
    assert "give that stage more memory, add stages with --pp-size" in message


def test_budgets_summing_below_the_model_say_so() -> None:
    with pytest.raises(ConfigurationError, match=r"together 40 B; 2 stages need at least 60 B"):
        balance_layers(synthetic([10] * 6), 2, [20, 20])


# -- stage counts ----------------------------------------------------------------------------


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(
        ConfigurationError, match="the model has 3 layers; use a --pp-size of at most 3"
    ):
        balance_layers(synthetic([1, 1, 1]), 4)


def test_groups_limit_the_stage_count() -> None:
    profile = synthetic([1] * 4, groups=[AdjacencyGroup(0, 2)])
    with pytest.raises(ConfigurationError, match="leave only 1 places to start a stage"):
        balance_layers(profile, 3)


# -- adjacency groups: the Gemma 4 e2b case --------------------------------------------------


def test_gemma4_e2b_auto_plan_cuts_no_kv_sharing_group() -> None:
    profile = profile_from_config(GEMMA4_E2B)
    assert profile.num_layers == 35 and len(profile.adjacency_groups) == 20
    plan = balance_layers(profile, 2)
    boundary = plan.stages[1].layer_range.start
    assert not any(g.is_cut_by(boundary) for g in profile.adjacency_groups)
    # Layers 14-34 are all bound to sources 13 and 14: stage 1 starts at 13 at the latest.
    assert boundary <= 13


def test_gemma4_e2b_validated_manual_split_is_accepted() -> None:
    plan = plan_from_pp_layers(profile_from_config(GEMMA4_E2B), "0-12,13-34")
    assert plan.ranges == (LayerRange(0, 13), LayerRange(13, 35))
    assert not plan.auto


def test_gemma4_e2b_manual_split_through_a_group_names_the_pair() -> None:
    with pytest.raises(ConfigurationError) as info:
        plan_from_pp_layers(profile_from_config(GEMMA4_E2B), "0-20,21-34")
    message = str(info.value)
    assert message.startswith("--pp-layers: the boundary between '0-20' and '21-34'")
    assert "separates layer 13 from layer 21 (layer 21 reads the KV cache of layer 13)" in message
    assert "start stage '21-34' at layer 13 instead" in message


def test_a_forced_join_that_unbalances_the_plan_is_a_warning_not_an_error() -> None:
    profile = synthetic([10] * 10, groups=[AdjacencyGroup(2, 7, "synthetic forced-join")])
    plan = balance_layers(profile, 2)
    # Layers 2-7 cannot be split: 80 / 20 is the best there is (earlier stage heavier on a tie).
    assert plan.ranges == (LayerRange(0, 8), LayerRange(8, 10))
    (warning,) = plan.warnings
    assert warning == (
        "pipeline auto-partition produced an imbalanced plan: stage byte loads range from 20 "
        "to 80 (4.00x), which may hurt throughput. Heaviest stage 0 carries adjacency group "
        "2..7 (synthetic forced-join). This is a hint to rebalance hardware, not an error."
    )


def test_a_balanced_plan_has_no_warning() -> None:
    assert balance_layers(synthetic([10] * 10), 2).warnings == ()


# -- manual plans ----------------------------------------------------------------------------


def test_manual_plan_over_budget_warns_with_the_shortfall() -> None:
    profile = synthetic([10] * 4, embedding=5)
    plan = plan_layers(profile, (LayerRange(0, 3), LayerRange(3, 4)), [30, 100])
    assert plan.stages[0].shortfall_bytes == 5
    assert any("stage 0 needs 35 B" in w and "short by 5 B" in w for w in plan.warnings)


def test_manual_plan_that_is_imbalanced_suggests_the_auto_plan() -> None:
    plan = plan_layers(synthetic([10] * 10), (LayerRange(0, 1), LayerRange(1, 10)))
    assert any("the auto partitioner would use 0-4,5-9 (1.00x)" in w for w in plan.warnings)


def test_plan_json_has_the_documented_shape() -> None:
    profile = synthetic([1, 2, 3], embedding=4, lm_head=5, groups=[AdjacencyGroup(1, 2)])
    doc = balance_layers(profile, 2, [100, None]).to_json()
    assert set(doc) == {
        "stages",
        "layer_bytes",
        "embedding_bytes",
        "lm_head_bytes",
        "adjacency_groups",
        "imbalance",
        "warnings",
    }
    assert doc["stages"][0] == {
        "stage_index": 0,
        "layer_range": [0, 1],
        "has_embedding": True,
        "has_lm_head": False,
        "estimated_memory_bytes": 5,
        "budget_bytes": 100,
    }
    assert doc["stages"][1]["layer_range"] == [1, 3] and doc["stages"][1]["budget_bytes"] is None
    assert doc["layer_bytes"] == [1, 2, 3] and doc["adjacency_groups"] == [[1, 2]]
    assert doc["imbalance"] == pytest.approx(2.0)


# -- sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64GiB", 64 * GiB),
        ("16GB", 16 * 10**9),
        ("512MiB", 512 * 2**20),
        ("512 mb", 512 * 10**6),
        ("1.5G", 3 * GiB // 2),
        ("8g", 8 * GiB),
        ("1073741824", GiB),
        (" 2 TiB ", 2 * 2**40),
        ("100B", 100),
    ],
)
def test_byte_sizes(text: str, expected: int) -> None:
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "64XB", "-1GiB", "1e9", "64 Gi B", "0", "0.0001B"])
def test_bad_byte_sizes_say_what_is_expected(text: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_byte_size(text)
    assert str(info.value).startswith("--stage-memory: ")
    assert "memory size" in str(info.value) or "positive" in str(info.value)


def test_one_stage_memory_value_applies_to_every_stage() -> None:
    assert parse_stage_memory("8GiB", 3) == (8 * GiB,) * 3
    assert parse_stage_memory("8GiB, 4GiB", 2) == (8 * GiB, 4 * GiB)


def test_stage_memory_count_must_match_the_stages() -> None:
    with pytest.raises(ConfigurationError, match="gives 3 sizes for 2 stages"):
        parse_stage_memory("1GiB,2GiB,3GiB", 2)
    with pytest.raises(ConfigurationError, match="empty entry"):
        parse_stage_memory("1GiB,,2GiB", 3)


def test_format_bytes_uses_binary_units() -> None:
    assert [format_bytes(n) for n in (512, 1536, 5 * 2**20, 12 * GiB)] == [
        "512 B",
        "1.50 KiB",
        "5.00 MiB",
        "12.0 GiB",
    ]


def test_stages_on_one_host_balance_time_not_bytes() -> None:
    """Tied ends: bytes put 10 + 10 layers beside a table of 8 layers each; time counts the
    lookup as nothing and the head, read by decode steps only, as half: 12 + 8."""
    tied = synthetic([10] * 20, embedding=80, lm_head=80, shared=80)
    assert [(r.start, r.end) for r in balance_layers(tied, 2).ranges] == [(0, 10), (10, 20)]
    assert [(r.start, r.end) for r in balance_compute(tied, 2)] == [(0, 12), (12, 20)]
    # Three stages: bytes leave the middle one most of the layers; time spreads them.
    assert [(r.start, r.end) for r in balance_layers(tied, 3).ranges] == [(0, 4), (4, 16), (16, 20)]
    assert [(r.start, r.end) for r in balance_compute(tied, 3)] == [(0, 8), (8, 16), (16, 20)]
