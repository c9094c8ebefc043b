"""Real stage workers on loopback and the real coordinator, in this process: the pipeline
the in-process tests drive (two stages; of a tiny checkpoint, layers 0-2 and 3-5), the stage
workers themselves, and the cluster TOML of two stages on loopback that the coordinator reads."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.profile.model import read_model_config
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.coordinator.coordinator import Coordinator
from mlxppd.runtime.node_start import CoordinatorSetup, start_pipeline_coordinator
from mlxppd.runtime.stage.loader import layer_preparer, load_stage_runner, stage_kv_manager
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport
from tests.support.node_keys import node_key_for, roster_toml
from tests.support.wire import CLUSTER, SECRET, config

SPLIT = (StageSpec(0, 2, 0, 3), StageSpec(1, 2, 3, 6))

#: two stages on loopback and a coordinator (``str.format`` fills name, port0 and port1)
CLUSTER_TOML = """\
[cluster]
name = "{name}"
pipeline_parallel_size = 2

[[nodes]]
id = "coordinator"
address = "127.0.0.1:1"
role = "coordinator"

[[nodes]]
id = "stage-0"
address = "127.0.0.1:{port0}"
role = "pipeline_stage"
stage = 0

[[nodes]]
id = "stage-1"
address = "127.0.0.1:{port1}"
role = "pipeline_stage"
stage = 1
"""
#: the TOML's [roster]: each node's test key (the stage workers hold theirs, tests/support/wire.py)
CLUSTER_TOML += roster_toml(["coordinator", "stage-0", "stage-1"])  # base64: no braces


async def stage_worker(
    model_dir: Path, mlx: MlxThread, spec: StageSpec, *, movable: bool = False, sequences: int = 8
) -> StageWorker:
    """A real stage worker for ``spec`` of the checkpoint in ``model_dir``, node id
    ``stage-<index>``, not started yet; ``movable``: it can take new layers (a repartition);
    ``sequences``: how many it holds KV for at once."""
    model_config = read_model_config(model_dir)
    runner, per_token = await load_stage_runner(mlx, model_dir, spec, model_config)
    kv = stage_kv_manager(spec, per_token, None, sequences)
    transport = create_transport("tcp", config(f"stage-{spec.index}"))
    prepare = layer_preparer(mlx, model_dir, model_config, None, 8) if movable else None
    return StageWorker(spec, runner, kv, transport, mlx, prepare_layers=prepare)


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
            node_key=node_key_for("coordinator"),
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
