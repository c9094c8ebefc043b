"""A stage keeps mlx's buffer cache in bounds: capped while it serves, given back once it has
stayed idle, and reported in its status (mlx's default keeps freed buffers up to its memory
limit: a soak's stages grew 7-10 % in 20 minutes with nothing leaking). A real stage worker on
the embedded model, over a real channel; the idle delay is injected."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlxppd.core.protocol.control import Release, StageReport, Status
from mlxppd.engine.mlx_memory import DEFAULT_CACHE_LIMIT_BYTES
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.support.stage_peer import connected
from tests.support.wire import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_LAYERS = 30


def test_an_idle_stage_gives_its_cache_back_and_reports_it(embedded_model_dir: Path) -> None:
    async def scenario() -> None:
        mlx = MlxThread("cache-mlx")
        worker, peer = await connected(embedded_model_dir, mlx, NUM_LAYERS)
        worker.cache.idle_after_s = 0.05
        try:
            assert worker.cache.limit_bytes == DEFAULT_CACHE_LIMIT_BYTES
            # glibc keeps large freed buffers mapped on their own, so free returns them
            assert worker.cache.malloc_bounded is (sys.platform == "linux")
            assert await mlx.run(lambda: mx.set_cache_limit(0)) == DEFAULT_CACHE_LIMIT_BYTES
            await mlx.run(lambda: mx.set_cache_limit(DEFAULT_CACHE_LIMIT_BYTES))

            await peer.admit("one")
            await peer.greedy("one", 3)
            busy = await peer.control.ask(Status(), StageReport)
            assert busy.memory is not None and busy.memory.cache_bytes > 0  # reused buffers
            assert busy.memory.active_bytes > 0 and busy.memory.peak_bytes > 0

            await peer.control.tell(Release(seq="one"))
            while worker.cache.cleared == 0:
                await asyncio.sleep(0.02)
            idle = await peer.control.ask(Status(), StageReport)
            assert idle.memory is not None and idle.memory.cache_bytes == 0
            assert idle.memory.active_bytes >= worker.runner.stage.parameter_bytes // 2
        finally:
            await peer.close()
            await worker.close()
            mlx.close()

    run(scenario)


def test_back_to_back_requests_keep_the_cache(embedded_model_dir: Path) -> None:
    """A request that follows within the idle delay finds the buffers the last one left."""

    async def scenario() -> None:
        mlx = MlxThread("cache-mlx")
        worker, peer = await connected(embedded_model_dir, mlx, NUM_LAYERS)
        worker.cache.idle_after_s = 3600.0
        try:
            for seq in ("a", "b"):
                await peer.admit(seq)
                await peer.greedy(seq, 2)
                await peer.control.tell(Release(seq=seq))
            report = await peer.control.ask(Status(), StageReport)
            assert report.memory is not None and report.memory.cache_bytes > 0
            assert worker.cache.cleared == 0
        finally:
            await peer.close()
            await worker.close()
            mlx.close()

    run(scenario)
