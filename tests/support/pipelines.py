"""Real stage workers on loopback and the real coordinator, in this process: the pipeline
the in-process tests drive (two stages; of a tiny checkpoint, layers 0-2 and 3-5)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.coordinator.coordinator import Coordinator
from mlxppd.runtime.node_start import CoordinatorSetup, start_pipeline_coordinator
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.runtime.coordinator.test_sequence_isolation import CLUSTER_TOML
from tests.support.wire import CLUSTER, SECRET

SPLIT = (StageSpec(0, 2, 0, 3), StageSpec(1, 2, 3, 6))


@asynccontextmanager
async def pipeline(
    workers: list[StageWorker], mlx: MlxThread, model: Path | None = None, **setup: Any
) -> AsyncIterator[Coordinator]:
    """Start ``workers`` (stage 0, stage 1) and a coordinator over them; ``model``: the
    coordinator's own copy, to check the stages' identity against; ``setup``: the
    :class:`CoordinatorSetup` fields that differ from one sequence at a time, no warm-up.
    Everything is closed on the way out, ``mlx`` too."""
    try:
        ports = [(await w.start("127.0.0.1", 0))[1] for w in workers]
        cluster = parse_cluster_config(
            CLUSTER_TOML.format(name=CLUSTER, port0=ports[0], port1=ports[1]), "test.toml"
        )
        plan = tuple(LayerRange(w.spec.start, w.spec.end) for w in workers)
        base = CoordinatorSetup(
            cluster=cluster, node_id="coordinator", secret=SECRET, transport="tcp", plan=plan,
            micro_batch_size=1, parallel=4, warmup=False, align=False,
        )  # fmt: skip
        if model is not None:
            config = json.loads((model / "config.json").read_text())
            base = replace(base, model_config=config, model_dir=model)
        coordinator = await start_pipeline_coordinator(replace(base, **setup), None, "tiny", None)
        try:
            yield coordinator
        finally:
            await coordinator.close()
    finally:
        for worker in workers:
            await worker.close()
        mlx.close()
