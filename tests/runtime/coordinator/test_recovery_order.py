"""The order a recovery tries its options in, on real stage workers over loopback in this
process (a tiny 6-layer llama, two stages of three layers, and a standby node):

1. the lost node itself, when it comes back within the grace, even with a standby idle;
2. else an idle standby, which loads only the lost stage's layers;
3. else the survivors, when the partitioner fits the model in their memory;
4. else the requests fail, and the pipeline serves again once the lost node is back.

A request streaming through the loss ends with the tokens it would have had without it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mlxppd.core.serving_state import ServingState
from mlxppd.runtime.backends.contract import BackendUnavailable
from mlxppd.runtime.coordinator.coordinator import Coordinator
from tests.conftest import TINY_LLAMA
from tests.support.recovery_cluster import SPLIT, cluster_of, tokens, wait_serving
from tests.support.wire import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def lost_under_a_stream(
    coordinator: Coordinator, lose: Callable[[], object]
) -> tuple[list[int], list[int]]:
    """A reference run, then the same request with ``lose`` after its 6th token."""
    reference = await tokens(coordinator, "reference")
    replayed = await tokens(coordinator, "through-the-loss", 6, lose)
    return reference, replayed


def test_the_lost_node_itself_comes_first_even_with_a_standby_idle(
    tiny_model: Callable[..., Path],
) -> None:
    model = tiny_model("recovery-llama", TINY_LLAMA)

    async def scenario() -> tuple[list[int], list[int], str, list[str]]:
        async with cluster_of(model, standbys=1, failover={"reconnect_grace_s": 20.0}) as (
            nodes, coordinator,
        ):  # fmt: skip

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
        async with cluster_of(model, standbys=1) as (nodes, coordinator):
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
        async with cluster_of(model) as (nodes, coordinator):
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
        async with cluster_of(model, budgets={"stage-0": 4096}) as (
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
