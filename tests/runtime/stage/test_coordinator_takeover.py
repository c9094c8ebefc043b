"""A coordinator that takes a stage over (the same one reconnected after a failover, or
another) finds it free of what the previous one held, and what it admits itself stays held
while the stage frees the rest: the freeing names the previous coordinator's sequences
instead of "everything" (a hung stage resumed by SIGCONT and reconnected once dropped the
replayed sequence it had just admitted: "not held on stage 2"). A real stage worker on the
embedded model, over real channels."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from mlxppd.core.protocol.pipeline import TokenMeta
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.codec import MessageKind
from tests.support.stage_peer import PROMPT, connect, connected
from tests.support.wire import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_LAYERS = 30


def test_a_new_coordinators_admission_outlives_the_old_coordinators_release(
    embedded_model_dir: Path,
) -> None:
    async def scenario() -> None:
        mlx = MlxThread("takeover-mlx")
        worker, old = await connected(embedded_model_dir, mlx, NUM_LAYERS)
        new = None
        gate = threading.Event()
        try:
            await old.admit("reference")
            alone = await old.prefill("reference")
            await old.admit("old")
            token = await old.prefill("old")
            # The compute loop is kept busy (a step of "old" behind a held mlx thread) while
            # the new coordinator configures and admits: the old one's release waits its turn.
            held = mlx.submit(gate.wait)
            await old.send("old", 1, np.asarray([[token]], dtype=np.int32))
            new = await connect(worker)
            assert not worker.kv.reserved  # the old one's budget freed on the takeover
            await new.admit("replayed")
            await new.send("replayed", 0, np.asarray([PROMPT], dtype=np.int32))
            await asyncio.sleep(0.2)  # the prefill queued behind the release
            gate.set()
            await held

            seen: dict[str, int] = {}
            while "replayed" not in seen:
                message = await asyncio.wait_for(new.data.get(), 60)
                assert message.kind is MessageKind.TOKENS, message.meta
                meta = TokenMeta.model_validate(dict(message.meta))
                seen[meta.seq] = int(np.frombuffer(message.tensor.data, dtype=np.int32)[0])
            assert seen["replayed"] == alone
            assert list(worker.kv.reserved) == ["replayed"]
            assert worker.runner is not None
            assert worker.runner.holds("replayed") and not worker.runner.holds("old")
            assert worker.stats.stale_steps == 0
        finally:
            gate.set()
            for peer in (old, new):
                if peer is not None:
                    await peer.close()
            await worker.close()
            mlx.close()

    run(scenario)
