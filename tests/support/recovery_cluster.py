"""Real stage workers over loopback in this process, on the ports of a cluster TOML with
failover, and the real coordinator over them: the pipeline the in-process recovery tests drive
(a tiny 6-layer llama split into stages, and standby nodes). A test kills and restarts workers
as a service manager would, and reads what the coordinator made of it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxppd.core.config.cluster import ClusterConfig, parse_cluster_config
from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.protocol.control import StageExtras
from mlxppd.core.serving_state import ServingState
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.backends.contract import SamplingParams
from mlxppd.runtime.coordinator.coordinator import Coordinator
from mlxppd.runtime.local_cluster import free_port
from mlxppd.runtime.node_start import (
    CoordinatorSetup,
    StageSetup,
    start_pipeline_coordinator,
    start_stage_worker,
)
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.support.node_keys import node_key_for, roster_toml
from tests.support.wire import CLUSTER, SECRET

PROMPT = [1, 17, 33, 9, 120, 5]
TOKENS = 24
#: two stages of three layers each
SPLIT = (StageSpec(0, 2, 0, 3), StageSpec(1, 2, 3, 6))
#: three stages of two layers each
SPLIT3 = (StageSpec(0, 3, 0, 2), StageSpec(1, 3, 2, 4), StageSpec(2, 3, 4, 6))


def plan_of(split: tuple[StageSpec, ...]) -> tuple[LayerRange, ...]:
    return tuple(LayerRange(s.start, s.end) for s in split)


#: the failover settings of every test cluster; a test overrides some (``failover=``)
FAILOVER: dict[str, Any] = {
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.0,
    "reconnect_grace_s": 1.0,
    "recovery_timeout_s": 60.0,
    "restore_layout": False,
}


def failover_toml(ports: list[int], stages: int, standbys: int, failover: dict[str, Any]) -> str:
    """The cluster TOML: a coordinator, ``stages`` stages and ``standbys`` standbys on
    loopback at ``ports`` (stages first), the ``failover`` table."""
    settings = "\n".join(
        f"{k} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}"
        for k, v in failover.items()
    )
    lines = [
        f'[cluster]\nname = "{CLUSTER}"\npipeline_parallel_size = {stages}\n',
        f"[cluster.failover]\n{settings}\n",
        '[[nodes]]\nid = "coordinator"\naddress = "127.0.0.1:1"\nrole = "coordinator"\n',
    ]
    for i in range(stages):
        lines.append(
            f'[[nodes]]\nid = "stage-{i}"\naddress = "127.0.0.1:{ports[i]}"\n'
            f'role = "pipeline_stage"\nstage = {i}\n'
        )
    for j in range(standbys):
        lines.append(
            f'[[nodes]]\nid = "standby-{j}"\naddress = "127.0.0.1:{ports[stages + j]}"\n'
            'role = "standby"\n'
        )
    ids = ["coordinator", *(f"stage-{i}" for i in range(stages))]
    ids += [f"standby-{j}" for j in range(standbys)]
    return "\n".join(lines) + roster_toml(ids)


@dataclass
class Nodes:
    """Stage workers of one test, each started (and restarted) on its node's port."""

    model: Path
    mlx: MlxThread
    cluster: ClusterConfig
    #: bytes each node reports it may hold (None: no limit), which the survivors' plan reads
    budgets: dict[str, int | None] = field(default_factory=dict)
    workers: dict[str, StageWorker] = field(default_factory=dict)

    async def start(self, node_id: str, spec: StageSpec, model: Path | None = None) -> StageWorker:
        """``node_id``'s worker serving ``spec`` (of ``model``: another checkpoint than the
        cluster's, say)."""
        node = next(n for n in self.cluster.nodes if n.id == node_id)
        model = model or self.model
        setup = StageSetup(
            cluster=self.cluster, node_id=node_id, secret=SECRET, model_dir=model,
            node_key=node_key_for(node_id),
            model_config=json.loads((model / "config.json").read_text()), spec=spec,
            host="127.0.0.1", port=node.port, transport="tcp", kv_budget_bytes=None,
            max_sequences=8, cpu_weights=CpuWeights.AUTO,
        )  # fmt: skip
        budget = self.budgets.get(node_id)
        extras = lambda: StageExtras(node_id=node_id, memory_budget_bytes=budget)  # noqa: E731
        worker, _ = await start_stage_worker(setup, self.mlx, extras)
        self.workers[node_id] = worker
        return worker

    async def kill(self, node_id: str) -> None:
        await self.workers.pop(node_id).close()

    async def close(self) -> None:
        for worker in self.workers.values():
            await worker.close()


@asynccontextmanager
async def cluster_of(
    model: Path, *, split: tuple[StageSpec, ...] = SPLIT, standbys: int = 0,
    budgets: dict[str, int | None] | None = None, failover: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[Nodes, Coordinator]]:  # fmt: skip
    """The stages of ``split`` (and ``standbys`` standbys) up, a coordinator with failover
    (``FAILOVER`` updated with ``failover``) over them."""
    ports = [free_port() for _ in range(len(split) + standbys)]
    text = failover_toml(ports, len(split), standbys, {**FAILOVER, **(failover or {})})
    mlx = MlxThread("recovery-mlx")
    nodes = Nodes(model, mlx, parse_cluster_config(text, "test.toml"), dict(budgets or {}))
    try:
        for spec in split:
            await nodes.start(f"stage-{spec.index}", spec)
        for j in range(standbys):
            await nodes.start(f"standby-{j}", StageSpec.standby(len(split)))
        setup = CoordinatorSetup(
            cluster=nodes.cluster, node_id="coordinator", secret=SECRET, transport="tcp",
            node_key=node_key_for("coordinator"),
            plan=plan_of(split), micro_batch_size=1, parallel=4, warmup=False, align=False,
            model_config=json.loads((model / "config.json").read_text()), model_dir=model,
        )  # fmt: skip
        coordinator = await start_pipeline_coordinator(setup, None, "tiny", None)
        try:
            yield nodes, coordinator
        finally:
            await coordinator.close()
    finally:
        await nodes.close()
        mlx.close()


async def tokens(
    coordinator: Coordinator, name: str, on_token: int = -1,
    lose: Callable[[], Any] | None = None, adapter: str | None = None,
) -> list[int]:  # fmt: skip
    """A greedy request's tokens; after token ``on_token``, ``await lose()`` runs (a stage
    lost, say)."""
    out = []
    params = SamplingParams(max_tokens=TOKENS, adapter=adapter)
    async for event in coordinator.generate(name, PROMPT, params):
        out.append(event.token)
        if len(out) == on_token and lose is not None:
            await lose()
    return out


async def wait_until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``predicate`` until it holds (a bounded wait on a condition, not on the clock)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def wait_serving(coordinator: Coordinator, timeout: float = 60.0) -> None:
    await wait_until(lambda: coordinator.serving.state is ServingState.SERVING, timeout)


def chain_ids(coordinator: Coordinator) -> list[str]:
    return [n.id for n in coordinator.chain_nodes()]
