"""Prefill chunk sizes: one big step on one stage, several chunks per stage on a pipeline (so
the stages overlap), small ones while other streams decode, the flag's value when given; once
the pipeline's speed is measured, sized from it."""

from __future__ import annotations

import pytest

from mlxppd.core.prefill_chunks import (
    MAX_CHUNK,
    MIN_CHUNK,
    SHARED_CHUNK,
    SINGLE_STAGE_CHUNK,
    SMOOTHING,
    PipelineSpeed,
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


# -- sized from the measured speed ----------------------------------------------------------

#: this machine's figures: 3.9 ms per prompt token, 100 ms per 2-stage decode step
CPU = PipelineSpeed(prefill_s_per_token=0.0039, decode_step_s=0.100)
#: a GPU's: a prompt token costs far less than a pass
GPU = PipelineSpeed(prefill_s_per_token=0.00005, decode_step_s=0.020)


def test_while_others_decode_a_chunk_costs_one_decode_pass() -> None:
    # 50 ms per stage's pass / 3.9 ms per token: 13 rows.
    assert prefill_chunk_size(1000, 2, True, speed=CPU) == 13
    assert prefill_chunk_size(1000, 2, True, speed=GPU) == 200
    # Unmeasured (or half measured): the default.
    half = PipelineSpeed(decode_step_s=0.1)
    assert prefill_chunk_size(1000, 2, True, speed=half) == SHARED_CHUNK


def test_alone_a_chunk_is_at_least_four_passes_worth() -> None:
    assert prefill_chunk_size(1000, 2, False, speed=CPU) == 125  # 4 x 13 < the bound
    assert prefill_chunk_size(1000, 2, False, speed=GPU) == 800  # 4 x 200 rows per chunk
    assert prefill_chunk_size(100_000, 2, False, speed=GPU) == 800
    assert prefill_chunk_size(1000, 1, False, speed=GPU) == SINGLE_STAGE_CHUNK


def test_the_speed_is_a_running_average_of_long_prompts_and_steps() -> None:
    speed = PipelineSpeed().prefilled(100, 5.0)  # too short to say anything
    assert speed.prefill_s_per_token == 0
    speed = speed.prefilled(1000, 4.0).prefilled(1000, 6.0)
    assert speed.prefill_s_per_token == pytest.approx(0.004 + SMOOTHING * 0.002)
    speed = speed.stepped(0.1).stepped(0.2)
    assert speed.decode_step_s == pytest.approx(0.1 + SMOOTHING * 0.1)
    assert speed.pass_rows(2) == pytest.approx(speed.decode_step_s / 2 / speed.prefill_s_per_token)
