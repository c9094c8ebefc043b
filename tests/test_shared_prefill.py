"""The ``n`` choices of one prompt share its prefill: every stage runs the prompt's head once
and copies the caches for the other choices, each of which then draws exactly what it draws
when run alone. Real stage workers on loopback, a tiny checkpoint, the real coordinator."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.pipeline.backend import SamplingParams
from mlxppd.runtime.pipeline.coordinator import Coordinator
from mlxppd.runtime.pipeline.node_start import CoordinatorSetup, start_pipeline_coordinator
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.conftest import TINY_LLAMA
from tests.test_sequence_isolation import CLUSTER_TOML, stage_worker
from tests.wire_support import CLUSTER, SECRET, run

SPLIT = (StageSpec(0, 2, 0, 3), StageSpec(1, 2, 3, 6))
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
        ports = [(await w.start("127.0.0.1", 0))[1] for w in workers]
        cluster = parse_cluster_config(
            CLUSTER_TOML.format(name=CLUSTER, port0=ports[0], port1=ports[1]), "test.toml"
        )
        setup = CoordinatorSetup(
            cluster=cluster, node_id="coordinator", secret=SECRET, transport="tcp",
            plan=(LayerRange(0, 3), LayerRange(3, 6)), micro_batch_size=4, parallel=8,
            warmup=False, align=False,
            model_config=json.loads((model / "config.json").read_text()), model_dir=model,
        )  # fmt: skip
        coordinator: Coordinator = await start_pipeline_coordinator(setup, None, "tiny", None)
        try:
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
        finally:
            await coordinator.close()
            for worker in workers:
                await worker.close()
            mlx.close()

    alone, shared, shared_passes, alone_passes = run(scenario)
    assert shared == alone  # each choice draws what it draws alone
    assert len({tuple(t) for t in shared}) > 1  # and the choices differ
    # Run alone, each choice prefills the head itself; shared, stage 0 runs it once.
    assert alone_passes - shared_passes >= len(CHOICES) - 1, (alone_passes, shared_passes)
