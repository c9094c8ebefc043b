"""A client that stops reading early takes only its own request down. Streams share micro-batch
groups; some are closed after a few tokens, while their group's next step is on its way. Every
other stream still gets exactly the tokens it gets alone, no stage reports a failed or stale
step (the coordinator frees a closed sequence only once no step carrying it is in flight), and
at the end the stages hold nothing. Two real stage workers on the embedded model, the real
coordinator, real sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mlxppd.core.stages import StageSpec
from mlxppd.runtime.backends.contract import SamplingParams
from mlxppd.runtime.coordinator.coordinator import Coordinator
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.support.pipelines import pipeline, stage_worker
from tests.support.stage_peer import PROMPT
from tests.support.wire import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SPLIT = (StageSpec(0, 2, 0, 15), StageSpec(1, 2, 15, 30))
TOKENS = 10


async def stream(coordinator: Coordinator, name: str, close_after: int | None) -> list[int]:
    """The stream's tokens; ``close_after``: the client closes it after that many."""
    events = coordinator.generate(name, PROMPT, SamplingParams(max_tokens=TOKENS))
    tokens: list[int] = []
    try:
        async for event in events:
            tokens.append(event.token)
            if close_after is not None and len(tokens) == close_after:
                break
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    return tokens


def test_streams_closed_early_fail_nothing_beside_them(embedded_model_dir: Path) -> None:
    async def scenario() -> None:
        mlx = MlxThread("early-close-mlx")
        workers = [await stage_worker(embedded_model_dir, mlx, spec) for spec in SPLIT]
        async with pipeline(workers, mlx, micro_batch_size=0, parallel=8) as coordinator:
            alone = await stream(coordinator, "alone", None)
            assert len(alone) == TOKENS
            for round_ in range(3):
                closes = [1 + (round_ + i) % 4 for i in range(3)]
                runs = [stream(coordinator, f"r{round_}.c{i}", n) for i, n in enumerate(closes)]
                runs += [stream(coordinator, f"r{round_}.k{i}", None) for i in range(3)]
                results = await asyncio.gather(*runs)
                for closed, n in zip(results[:3], closes, strict=True):
                    assert closed == alone[:n]
                assert results[3:] == [alone] * 3, f"round {round_}"
            for worker in workers:
                assert worker.stats.sequence_failures == 0
                assert worker.stats.stale_steps == 0
            deadline = asyncio.get_running_loop().time() + 60
            while any(w.kv.reserved or (w.runner and w.runner.active) for w in workers):
                assert asyncio.get_running_loop().time() < deadline, "stages still hold sequences"
                await asyncio.sleep(0.05)

    run(scenario, timeout=500)
