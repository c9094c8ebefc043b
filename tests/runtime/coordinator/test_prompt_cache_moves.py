"""A repartition drops every prompt-cache entry, on the coordinator and on every stage: a
stage that moved holds new runners (its entries went with the old ones), so a later request
with a kept prefix must not be routed to an entry nobody holds (the soak saw "prompt-cache
entry ... is not held here" after every repartition: a failed start and a wasted prefill).
Two real stage workers on the embedded model that can take new layers, the real coordinator."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.backends.contract import SamplingParams
from mlxppd.runtime.coordinator.coordinator import Coordinator
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.support.pipelines import pipeline, stage_worker
from tests.support.stage_peer import PROMPT
from tests.support.wire import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SPLIT = (StageSpec(0, 2, 0, 15), StageSpec(1, 2, 15, 30))
LONG = PROMPT * 6  # long enough to be kept and matched


async def answer(coordinator: Coordinator, name: str, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=6)
    return [e.token async for e in coordinator.generate(name, prompt, params)]


def test_a_repartition_forgets_every_kept_prefix(embedded_model_dir: Path) -> None:
    async def scenario() -> None:
        mlx = MlxThread("moves-mlx")
        workers = [
            await stage_worker(embedded_model_dir, mlx, spec, movable=True) for spec in SPLIT
        ]
        async with pipeline(workers, mlx, prompt_cache=8) as coordinator:
            first = await answer(coordinator, "first", LONG)
            assert coordinator.prompts is not None and len(coordinator.prompts) == 1
            await coordinator.move_stages((LayerRange(0, 12), LayerRange(12, 30)), 120)
            assert len(coordinator.prompts) == 0
            assert all(not w.kv.pinned for w in workers)
            assert await answer(coordinator, "again", [*LONG, *first]) == await answer(
                coordinator, "reference", [*LONG, *first]
            )
            assert [w.stats.sequence_failures for w in workers] == [0, 0]

    run(scenario, timeout=500)
