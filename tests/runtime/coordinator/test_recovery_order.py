"""The order a recovery tries its options in, on real stage workers over loopback in this
process (a tiny 6-layer llama, two stages of three layers, and a standby node):

1. the lost node itself, when it comes back within the grace, even with a standby idle;
2. else an idle standby, which loads only the lost stage's layers;
3. else the survivors, when the partitioner fits the model in their memory;
4. else the requests fail, and the pipeline serves again once the lost node is back.

A request streaming through the loss ends with the tokens it would have had without it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mlxppd.core.config.cluster import ClusterConfig, parse_cluster_config
from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.protocol.control import StageExtras
from mlxppd.core.serving_state import ServingState
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.backends.contract import BackendUnavailable, SamplingParams
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
from tests.conftest import TINY_LLAMA
from tests.support.wire import CLUSTER, SECRET, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [1, 17, 33, 9, 120, 5]
TOKENS = 24
SPLIT = (StageSpec(0, 2, 0, 3), StageSpec(1, 2, 3, 6))
PLAN = (LayerRange(0, 3), LayerRange(3, 6))

TOML = """\
[cluster]
name = "{name}"
pipeline_parallel_size = 2

[cluster.failover]
heartbeat_interval_s = 0.2
heartbeat_timeout_s = 1.0
reconnect_grace_s = {grace}
recovery_timeout_s = 60.0

[[nodes]]
id = "coordinator"
address = "127.0.0.1:1"
role = "coordinator"

[[nodes]]
id = "stage-0"
address = "127.0.0.1:{ports[0]}"
role = "pipeline_stage"
stage = 0

[[nodes]]
id = "stage-1"
address = "127.0.0.1:{ports[1]}"
role = "pipeline_stage"
stage = 1
"""
STANDBY = """
[[nodes]]
id = "standby-0"
address = "127.0.0.1:{ports[2]}"
role = "standby"
"""


@dataclass
class Cluster:
    """Stage workers of one test, each started (and restarted) on its node's port."""

    model: Path
    mlx: MlxThread
    cluster: ClusterConfig
    #: bytes each node reports it may hold (None: no limit), which the survivors' plan reads
    budgets: dict[str, int | None] = field(default_factory=dict)
    workers: dict[str, StageWorker] = field(default_factory=dict)

    async def start(self, node_id: str, spec: StageSpec) -> StageWorker:
        node = next(n for n in self.cluster.nodes if n.id == node_id)
        setup = StageSetup(
            cluster=self.cluster, node_id=node_id, secret=SECRET, model_dir=self.model,
            model_config=json.loads((self.model / "config.json").read_text()), spec=spec,
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
    model: Path, *, standby: bool, grace: float = 1.0, budgets: dict[str, int | None] | None = None
) -> AsyncIterator[tuple[Cluster, Coordinator]]:
    """Both stages (and the standby) up, a coordinator with failover over them."""
    ports = [free_port() for _ in range(3)]
    text = TOML.format(name=CLUSTER, ports=ports, grace=grace) + (
        STANDBY.format(ports=ports) if standby else ""
    )
    mlx = MlxThread("recovery-mlx")
    nodes = Cluster(model, mlx, parse_cluster_config(text, "test.toml"), dict(budgets or {}))
    try:
        for spec in SPLIT:
            await nodes.start(f"stage-{spec.index}", spec)
        if standby:
            await nodes.start("standby-0", StageSpec.standby(2))
        setup = CoordinatorSetup(
            cluster=nodes.cluster, node_id="coordinator", secret=SECRET, transport="tcp",
            plan=PLAN, micro_batch_size=1, parallel=4, warmup=False, align=False,
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


async def tokens(coordinator: Coordinator, name: str, on_token: int = -1,
                 lose: Callable[[], object] | None = None) -> list[int]:  # fmt: skip
    """A greedy request's tokens; after token ``on_token``, ``lose()`` runs (a stage lost)."""
    out = []
    async for event in coordinator.generate(name, PROMPT, SamplingParams(max_tokens=TOKENS)):
        out.append(event.token)
        if len(out) == on_token and lose is not None:
            await lose()  # type: ignore[misc]
    return out


async def lost_under_a_stream(
    coordinator: Coordinator, lose: Callable[[], object]
) -> tuple[list[int], list[int]]:
    """A reference run, then the same request with ``lose`` after its 6th token."""
    reference = await tokens(coordinator, "reference")
    replayed = await tokens(coordinator, "through-the-loss", 6, lose)
    return reference, replayed


async def wait_serving(coordinator: Coordinator, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while coordinator.serving.state is not ServingState.SERVING:
            await asyncio.sleep(0.05)


def test_the_lost_node_itself_comes_first_even_with_a_standby_idle(
    tiny_model: Callable[..., Path],
) -> None:
    model = tiny_model("recovery-llama", TINY_LLAMA)

    async def scenario() -> tuple[list[int], list[int], str, list[str]]:
        async with cluster_of(model, standby=True, grace=20.0) as (nodes, coordinator):

            async def restart() -> None:
                await nodes.kill("stage-1")
                await nodes.start("stage-1", SPLIT[1])

            reference, replayed = await lost_under_a_stream(coordinator, restart)
            return (
                reference,
                replayed,
                coordinator.failovers[-1].outcome,
                [n.id for n in coordinator.chain_nodes()],
            )

    reference, replayed, outcome, chain = run(scenario)
    assert replayed == reference
    assert outcome == "reconnected"
    assert chain == ["stage-0", "stage-1"]


def test_a_standby_takes_the_lost_layers_before_the_survivors_share_them(
    tiny_model: Callable[..., Path],
) -> None:
    model = tiny_model("recovery-llama", TINY_LLAMA)

    async def scenario() -> tuple[list[int], list[int], str, str, list[tuple[int, int]]]:
        async with cluster_of(model, standby=True) as (nodes, coordinator):
            reference, replayed = await lost_under_a_stream(
                coordinator, lambda: nodes.kill("stage-1")
            )
            event = coordinator.failovers[-1]
            held = [r.layers for r in await coordinator.stage_status()]
            return reference, replayed, event.outcome, event.detail, held

    reference, replayed, outcome, detail, held = run(scenario)
    assert replayed == reference
    assert (outcome, detail) == ("standby", "standby standby-0 took layers 3-5")
    assert held == [(0, 3), (3, 6)]


def test_without_a_standby_the_survivors_take_the_lost_layers(
    tiny_model: Callable[..., Path],
) -> None:
    model = tiny_model("recovery-llama", TINY_LLAMA)

    async def scenario() -> tuple[list[int], list[int], str, list[tuple[int, int]], list[str]]:
        async with cluster_of(model, standby=False) as (nodes, coordinator):
            reference, replayed = await lost_under_a_stream(
                coordinator, lambda: nodes.kill("stage-0")
            )
            held = [r.layers for r in await coordinator.stage_status()]
            chain = [n.id for n in coordinator.chain_nodes()]
            return reference, replayed, coordinator.failovers[-1].outcome, held, chain

    reference, replayed, outcome, held, chain = run(scenario)
    assert replayed == reference
    assert outcome == "survivors"
    assert (held, chain) == ([(0, 6)], ["stage-1"])


def test_with_no_room_anywhere_the_requests_fail_until_the_lost_node_is_back(
    tiny_model: Callable[..., Path],
) -> None:
    """The survivor reports a memory budget below the model's weights: nothing fits."""
    model = tiny_model("recovery-llama", TINY_LLAMA)

    async def scenario() -> tuple[str, str, str, ServingState, list[int]]:
        async with cluster_of(model, standby=False, budgets={"stage-0": 4096}) as (
            nodes, coordinator,
        ):  # fmt: skip
            reference = await tokens(coordinator, "reference")
            failed = "none"
            try:
                await tokens(coordinator, "doomed", 6, lambda: nodes.kill("stage-1"))
            except BackendUnavailable as exc:
                failed = str(exc)
            outcome = coordinator.failovers[-1].outcome
            health = coordinator.health().detail
            down = coordinator.serving.state
            await nodes.start("stage-1", SPLIT[1])
            await wait_serving(coordinator)
            again = await tokens(coordinator, "after")
            assert again == reference
            return failed, outcome, health, down, again

    failed, outcome, health, down, _ = run(scenario)
    assert outcome == "failed"
    assert down is ServingState.DOWN
    assert "lost stage 1 (stage-1)" in health and "lack the memory" in health
    assert failed.startswith("the pipeline is down: lost stage 1 (stage-1)"), failed
