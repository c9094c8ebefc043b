"""Prefill chunk sizes: one big step on one stage, several chunks per stage on a pipeline (so
the stages overlap), small ones while other streams decode, the flag's value when given."""

from __future__ import annotations

import pytest

from mlxppd.core.prefill_chunks import (
    MAX_CHUNK,
    MIN_CHUNK,
    SHARED_CHUNK,
    SINGLE_STAGE_CHUNK,
    prefill_chunk_size,
)


def test_one_stage_prefills_in_mlx_lms_step() -> None:
    assert prefill_chunk_size(1000, 1, False) == SINGLE_STAGE_CHUNK


@pytest.mark.parametrize(("tokens", "stages", "chunk"), [(1000, 2, 125), (1000, 3, 84)])
def test_a_pipeline_gets_four_chunks_per_stage(tokens: int, stages: int, chunk: int) -> None:
    assert prefill_chunk_size(tokens, stages, False) == chunk


def test_pipelined_chunks_stay_within_bounds() -> None:
    assert prefill_chunk_size(100, 2, False) == MIN_CHUNK
    assert prefill_chunk_size(100_000, 2, False) == MAX_CHUNK


def test_chunks_are_small_while_others_decode() -> None:
    assert prefill_chunk_size(1000, 2, True) == SHARED_CHUNK


def test_the_flag_wins_and_must_be_positive() -> None:
    assert prefill_chunk_size(1000, 2, True, override=300) == 300
    with pytest.raises(ValueError, match="at least one"):
        prefill_chunk_size(1000, 2, False, override=0)
