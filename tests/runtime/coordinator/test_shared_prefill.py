"""The ``n`` choices of one prompt share its prefill: every stage runs the prompt's head once
and copies the caches for the other choices, each of which then draws exactly what it draws
when run alone. Real stage workers on loopback, a tiny checkpoint, the real coordinator."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mlxppd.runtime.backends.contract import SamplingParams
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.conftest import TINY_LLAMA
from tests.support.pipelines import SPLIT, pipeline, stage_worker
from tests.support.wire import run

PROMPT = list(range(3, 40))  # a head of 36 tokens, then the last one
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, top_k=20, repetition_penalty=1.2)
CHOICES = [replace(PARAMS, seed=seed) for seed in (5, 6, 7)]


async def tokens_of(stream: object) -> list[int]:
    return [event.token async for event in stream]  # type: ignore[attr-defined]


def test_choices_share_the_head_and_each_equals_its_own_run(
    tiny_model: Callable[..., Path],
) -> None:
    model = tiny_model("shared-prefill-llama", TINY_LLAMA)

    async def scenario() -> tuple[list[list[int]], list[list[int]], int, int]:
        mlx = MlxThread("shared-prefill-mlx")
        workers = [await stage_worker(model, mlx, spec) for spec in SPLIT]
        async with pipeline(workers, mlx, model, micro_batch_size=4, parallel=8) as coordinator:
            alone = [await tokens_of(coordinator.generate("alone", PROMPT, p)) for p in CHOICES]
            before = workers[0].stats.forwards
            streams = coordinator.generate_choices("shared", PROMPT, CHOICES)
            # Together, as the HTTP layer iterates them: a follower waits for the head.
            shared = list(await asyncio.gather(*(tokens_of(s) for s in streams)))
            shared_passes = workers[0].stats.forwards - before
            before = workers[0].stats.forwards
            for p in CHOICES:
                await tokens_of(coordinator.generate("again", PROMPT, p))
            alone_passes = workers[0].stats.forwards - before
            return alone, shared, shared_passes, alone_passes

    alone, shared, shared_passes, alone_passes = run(scenario)
    assert shared == alone  # each choice draws what it draws alone
    assert len({tuple(t) for t in shared}) > 1  # and the choices differ
    # Run alone, each choice prefills the head itself; shared, stage 0 runs it once.
    assert alone_passes - shared_passes >= len(CHOICES) - 1, (alone_passes, shared_passes)
