"""Coordinated KV admission: a dry run on every stage, then a commit on all or none."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mlxppd.core.kv_admission import (
    AdmissionRequest,
    RejectReason,
    SlotKvManager,
    StageKvManager,
    coordinated_admission,
)


def _stages(*budgets: int, per_token: int = 10, cap: int = 100) -> list[StageKvManager]:
    return [
        StageKvManager(stage_index=i, budget_bytes=b, bytes_per_token=per_token, max_sequences=cap)
        for i, b in enumerate(budgets)
    ]


def test_admitted_request_is_reserved_on_every_stage() -> None:
    stages = _stages(1000, 1000)
    assert coordinated_admission(stages, AdmissionRequest("a", 30, 20)) is None
    assert [s.used_bytes for s in stages] == [500, 500]


def test_the_smallest_stage_rejects_and_nothing_is_committed_anywhere() -> None:
    stages = _stages(1000, 400, 1000)
    problem = coordinated_admission(stages, AdmissionRequest("long", 30, 20))
    assert problem is not None
    assert problem.stage_index == 1
    assert problem.reason is RejectReason.MEMORY
    assert (problem.required_bytes, problem.budget_bytes, problem.available_bytes) == (
        500,
        400,
        400,
    )
    # More than the stage's whole budget: waiting cannot help, and the message says so.
    assert problem.never_fits
    assert "needs 500 KV bytes on stage 1, more than its whole budget of 400" in problem.message()
    assert all(s.used_bytes == 0 for s in stages)
    # and a short request still gets in
    assert coordinated_admission(stages, AdmissionRequest("short", 10, 10)) is None


def test_a_request_that_fits_an_empty_budget_is_told_to_retry() -> None:
    stages = _stages(1000)
    assert coordinated_admission(stages, AdmissionRequest("first", 60, 20)) is None  # 800 B
    problem = coordinated_admission(stages, AdmissionRequest("later", 40, 10))  # 500 B
    assert problem is not None and not problem.never_fits
    assert "stage 0 has 200 of 1000 KV bytes free" in problem.message()
    assert "retry when other requests finish" in problem.message()


def test_sequence_cap_and_duplicate_ids_are_their_own_reasons() -> None:
    stages = _stages(10_000, 10_000, cap=1)
    assert coordinated_admission(stages, AdmissionRequest("a", 1, 1)) is None
    dup = coordinated_admission(stages, AdmissionRequest("a", 1, 1))
    assert dup is not None and dup.reason is RejectReason.ALREADY_CACHED
    cap = coordinated_admission(stages, AdmissionRequest("b", 1, 1))
    assert cap is not None and cap.reason is RejectReason.SEQUENCE_CAP
    assert cap.active_sequences == 1


def test_release_frees_the_reservation_on_every_stage() -> None:
    stages = _stages(500, 500)
    assert coordinated_admission(stages, AdmissionRequest("a", 25, 25)) is None
    assert coordinated_admission(stages, AdmissionRequest("b", 1, 1)) is not None
    assert all(s.release("a") for s in stages)
    assert not stages[0].release("a")
    assert coordinated_admission(stages, AdmissionRequest("b", 1, 1)) is None


@given(
    st.lists(st.integers(0, 2000), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(1, 50), st.integers(0, 50)), max_size=30),
)
def test_no_stage_ever_exceeds_its_budget(
    budgets: list[int], requests: list[tuple[int, int]]
) -> None:
    stages = _stages(*budgets)
    for n, (prompt, new) in enumerate(requests):
        coordinated_admission(stages, AdmissionRequest(str(n), prompt, new))
        assert all(s.used_bytes <= s.budget_bytes for s in stages)
        # all stages agree on who is admitted
        assert len({frozenset(s.reserved) for s in stages}) == 1


# -- a tensor-parallel stage: one accounting per (stage, rank) slot ----------------------------


def _slots(*budgets: int, per_token: int = 10) -> SlotKvManager:
    """Stage 1 of a 2D cluster, kept by its rank 0: one budget per rank."""
    others = [StageKvManager(1, b, per_token, rank=r) for r, b in enumerate(budgets) if r]
    return SlotKvManager(1, budgets[0], per_token, rank=0, others=others)


def test_a_slot_too_small_refuses_naming_stage_and_rank_and_no_slot_commits() -> None:
    stage = _slots(10_000, 10_000, 300)
    problem = stage.dry_run(AdmissionRequest("long", 30, 20))
    assert problem is not None and (problem.stage_index, problem.rank) == (1, 2)
    assert "on stage 1 rank 2, more than its whole budget of 300" in problem.message()
    assert coordinated_admission([stage], AdmissionRequest("long", 30, 20)) == problem
    assert [s.used_bytes for s in stage.slots] == [0, 0, 0]


def test_an_admitted_sequence_holds_kv_on_every_slot_until_released() -> None:
    stage = _slots(10_000, 10_000)
    assert coordinated_admission([stage], AdmissionRequest("a", 30, 20)) is None
    stage.pin("entry", 10)
    assert [s.used_bytes for s in stage.slots] == [600, 600]
    assert stage.release("a")
    stage.unpin("entry")
    assert [s.used_bytes for s in stage.slots] == [0, 0]
    stage.commit(AdmissionRequest("b", 1, 1))
    stage.clear()
    assert [(s.reserved, s.pinned) for s in stage.slots] == [({}, {}), ({}, {})]


def test_a_refusal_names_its_rank_on_the_wire_too() -> None:
    from mlxppd.core.protocol.control import AdmitRefusal

    problem = _slots(10_000, 5).dry_run(AdmissionRequest("x", 1, 1))
    assert problem is not None
    assert AdmitRefusal.of(problem).diagnostic() == problem
    assert problem.where == "stage 1 rank 1"
