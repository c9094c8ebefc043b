"""Adapter loads on real stage workers over loopback, in this process (a tiny llama, two
stages): a stage lost during a load fails the load naming it, and the stages that did load
the adapter drop it again, so no stage is left holding an adapter the cluster does not serve."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.errors import TemporaryError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.runtime.node_start import CoordinatorSetup, start_pipeline_coordinator
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.conftest import TINY_LLAMA
from tests.support.adapters import random_adapter
from tests.support.node_keys import node_key_for
from tests.support.pipelines import CLUSTER_TOML, SPLIT, stage_worker
from tests.support.wire import CLUSTER, SECRET, run

#: without failover a lost stage takes the pipeline down and the others keep their links
NO_FAILOVER = "\n[cluster.failover]\nenabled = false\n"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def held(worker: object) -> list[str]:
    """The per-request adapters a stage worker holds."""
    adapters = worker.runner.stage.adapters  # type: ignore[attr-defined]
    return sorted(adapters.named)


def test_a_stage_lost_during_a_load_refuses_it_and_the_others_drop_it(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model("adapter-llama", TINY_LLAMA)
    adapter = random_adapter(model, tmp_path / "pirate", num_layers=6)

    async def scenario() -> tuple[str, list[str], list[str], bool]:
        mlx = MlxThread("adapter-mlx")
        workers = [await stage_worker(model, mlx, spec) for spec in SPLIT]
        ports = [(await w.start("127.0.0.1", 0))[1] for w in workers]
        text = CLUSTER_TOML.format(name=CLUSTER, port0=ports[0], port1=ports[1])
        text = text.replace("\n\n[[nodes]]", NO_FAILOVER + "\n[[nodes]]", 1)
        cluster = parse_cluster_config(text, "test.toml")
        setup = CoordinatorSetup(
            cluster=cluster, node_id="coordinator", secret=SECRET, transport="tcp",
            node_key=node_key_for("coordinator"),
            plan=(LayerRange(0, 3), LayerRange(3, 6)), micro_batch_size=1, parallel=4,
            warmup=False, align=False,
        )  # fmt: skip
        coordinator = await start_pipeline_coordinator(setup, None, "tiny", None)
        try:
            await workers[1].close()  # stage 1's host goes away as the load is sent
            try:
                await coordinator.load_adapter("pirate", str(adapter))
                refused = ""
            except TemporaryError as exc:
                refused = str(exc)
            return refused, held(workers[0]), coordinator.adapters.names(), coordinator.connected
        finally:
            await coordinator.close()
            await workers[0].close()
            mlx.close()

    refused, stage0, served, connected = run(scenario)
    assert refused.startswith("adapter 'pirate' was not loaded: stage 1: no answer"), refused
    assert stage0 == []  # stage 0 loaded it, then dropped it again
    assert "pirate" not in served
    assert not connected  # without [cluster.failover] the lost stage takes the pipeline down
