"""What a failover does after the first loss, on real stage workers over loopback in this
process (a tiny 6-layer llama in stages, standby nodes):

- a second stage lost while the recovery runs restarts it on the stages left;
- once the lost nodes serve again, the cluster file's layout comes back by itself, and a
  stream running through the restore ends with the tokens it would have had; a restore that
  cannot have the file's layout rebuilds the one that served;
- a standby that adopted a stage, and served no more once the layout came back, may adopt
  again;
- an adopted standby holds the adapters loaded while the cluster served, not only the file's;
- a repartition over a survivors' pipeline plans for the stages serving, not the file's.

Every stream is compared with the same request on the undisturbed pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mlxppd.core.agent.elastic import ElasticState, Trigger
from mlxppd.core.config.cluster import ElasticPolicy
from mlxppd.core.cpu_weights import float32_config
from mlxppd.core.profile.model import profile_from_config, read_model_config
from mlxppd.core.serving_state import ServingState
from mlxppd.runtime.coordinator.elastic_driver import ElasticDriver
from mlxppd.runtime.coordinator.gate import GatedBackend
from tests.conftest import TINY_LLAMA
from tests.support.adapters import random_adapter
from tests.support.recovery_cluster import (
    SPLIT,
    SPLIT3,
    chain_ids,
    cluster_of,
    plan_of,
    tokens,
    wait_serving,
    wait_until,
)
from tests.support.wire import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FILE_NODES = ["stage-0", "stage-1", "stage-2"]


def test_a_second_stage_lost_during_the_recovery_restarts_it_on_the_survivors_left(
    tiny_model: Callable[..., Path],
) -> None:
    """Stage 1 dies mid-stream; while the recovery waits out its grace for it, stage 2 dies
    too: the next pass builds on stage 0 and the standby, and the stream ends unchanged."""
    model = tiny_model("recovery-llama", TINY_LLAMA)

    async def scenario() -> tuple[list[int], list[int], str, str, list[str], int]:
        async with cluster_of(
            model, split=SPLIT3, standbys=1, failover={"reconnect_grace_s": 3.0}
        ) as (nodes, coordinator):
            reference = await tokens(coordinator, "reference")

            async def lose_two() -> None:
                await nodes.kill("stage-1")
                await wait_until(lambda: coordinator.serving.state is ServingState.RECOVERING)
                await nodes.kill("stage-2")  # within the first pass's grace

            replayed = await tokens(coordinator, "through-two-losses", 6, lose_two)
            event = coordinator.failovers[-1]
            return (reference, replayed, event.outcome, event.detail, chain_ids(coordinator),
                    len(coordinator.failovers))  # fmt: skip

    reference, replayed, outcome, detail, chain, failovers = run(scenario)
    assert replayed == reference
    assert (outcome, failovers) == ("standby", 1)  # one recovery, restarted, not two
    assert detail.startswith("stages 1 (stage-1) and 2 (stage-2) were lost; 1 survivors and "
                             "standby standby-0 now hold 0-"), detail  # fmt: skip
    assert chain == ["stage-0", "standby-0"]


def test_the_files_layout_comes_back_by_itself_and_a_stream_through_it_is_unchanged(
    tiny_model: Callable[..., Path],
) -> None:
    """After the survivors and the standby took over, both lost nodes come back: once they
    have answered for restore_after_s the coordinator restores the file's nodes and layers
    by itself; a stream caught by a restore (run here by hand, mid-stream) pauses and ends
    with the reference tokens."""
    model = tiny_model("recovery-llama", TINY_LLAMA)
    failover = {"restore_layout": True, "restore_after_s": 0.5, "restore_drain_s": 0.2}

    async def scenario() -> tuple[list[int], list[int], list[int], list[str], list[str]]:
        async with cluster_of(model, split=SPLIT3, standbys=1, failover=failover) as (
            nodes, coordinator,
        ):  # fmt: skip
            reference = await tokens(coordinator, "reference")
            await nodes.kill("stage-1")
            await nodes.kill("stage-2")
            await wait_until(lambda: len(coordinator.chain_nodes()) == 2
                             and coordinator.serving.state is ServingState.SERVING)  # fmt: skip
            during = chain_ids(coordinator)
            await nodes.start("stage-1", SPLIT3[1])
            await nodes.start("stage-2", SPLIT3[2])
            await wait_until(lambda: chain_ids(coordinator) == FILE_NODES)
            await wait_serving(coordinator)
            assert coordinator.plan == plan_of(SPLIT3)
            assert [r.layers for r in await coordinator.stage_status()] == [
                (0, 2), (2, 4), (4, 6),
            ]  # fmt: skip
            after = await tokens(coordinator, "restored")
            # A restore caught mid-stream: the stream pauses, and goes on on the new chain.
            await nodes.kill("stage-2")
            await wait_until(lambda: chain_ids(coordinator) == ["stage-0", "stage-1", "standby-0"]
                             and coordinator.serving.state is ServingState.SERVING)  # fmt: skip
            coordinator.admission_held = lambda: True  # as a drain would: no restore by itself
            await nodes.start("stage-2", SPLIT3[2])
            through = await tokens(coordinator, "through-a-restore", 6, coordinator.restore_layout)
            return reference, after, through, during, chain_ids(coordinator)

    reference, after, through, during, chain = run(scenario)
    assert during == ["stage-0", "standby-0"]
    assert after == reference
    assert through == reference
    assert chain == FILE_NODES


def test_a_restore_that_cannot_have_the_files_layout_goes_back_to_the_one_that_served(
    tiny_model: Callable[..., Path],
) -> None:
    """Stage 1 comes back serving another checkpoint: it answers, so a restore runs, but its
    identity check refuses it; the layout that served (stage 0 and the standby) is rebuilt,
    requests get the same tokens, and the next try waits longer."""
    model = tiny_model("recovery-llama", TINY_LLAMA)
    other = tiny_model("other-llama", {**TINY_LLAMA, "rms_norm_eps": 1e-6})
    failover = {"restore_layout": True, "restore_after_s": 0.2, "restore_drain_s": 0.2}

    async def scenario() -> tuple[list[int], list[int], list[str], int]:
        async with cluster_of(model, standbys=1, failover=failover) as (nodes, coordinator):
            reference = await tokens(coordinator, "reference")
            await nodes.kill("stage-1")
            await wait_until(lambda: chain_ids(coordinator) == ["stage-0", "standby-0"])
            await nodes.start("stage-1", SPLIT[1], other)
            restorer = coordinator.restorer
            assert restorer is not None
            await wait_until(lambda: restorer.watch.failures == 1)
            await wait_serving(coordinator)
            after = await tokens(coordinator, "after-a-failed-restore")
            return reference, after, chain_ids(coordinator), restorer.watch.failures

    reference, after, chain, failures = run(scenario)
    assert after == reference
    assert chain == ["stage-0", "standby-0"]
    assert failures >= 1  # (a later try may have failed too: the node still serves another)


def test_a_standby_that_served_no_more_after_a_restore_adopts_again(
    tiny_model: Callable[..., Path],
) -> None:
    """The standby adopts stage 1, stage 1 returns and takes its layers back; then stage 0
    dies: the standby, still holding stage 1's layers but in no stage now, takes stage 0's."""
    model = tiny_model("recovery-llama", TINY_LLAMA)
    failover = {"restore_layout": True, "restore_after_s": 0.2, "restore_drain_s": 0.2}

    async def scenario() -> tuple[list[int], list[int], list[str], str]:
        async with cluster_of(model, standbys=1, failover=failover) as (nodes, coordinator):
            reference = await tokens(coordinator, "reference")
            await nodes.kill("stage-1")
            await wait_until(lambda: chain_ids(coordinator) == ["stage-0", "standby-0"])
            await nodes.start("stage-1", SPLIT[1])
            await wait_until(lambda: chain_ids(coordinator) == ["stage-0", "stage-1"])
            await wait_serving(coordinator)
            again = await tokens(coordinator, "lost-again", 6, lambda: nodes.kill("stage-0"))
            return reference, again, chain_ids(coordinator), coordinator.failovers[-1].detail

    reference, again, chain, detail = run(scenario)
    assert again == reference
    assert chain == ["standby-0", "stage-1"]
    assert detail == "standby standby-0 took layers 0-2"


def test_an_adopted_standby_holds_the_adapters_loaded_while_the_cluster_served(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """An adapter loaded live (not in the cluster file): stage 1 dies under a stream that
    uses it, the standby adopts stage 1's layers and is given the adapter too, and the
    stream ends with the adapter's tokens."""
    model = tiny_model("recovery-llama", TINY_LLAMA)
    adapter = random_adapter(model, tmp_path / "pirate", num_layers=6)

    async def scenario() -> tuple[list[int], list[int], list[int], list[str]]:
        async with cluster_of(model, standbys=1) as (nodes, coordinator):
            await coordinator.load_adapter("pirate", str(adapter))
            base = await tokens(coordinator, "base")
            reference = await tokens(coordinator, "adapted", adapter="pirate")
            lose = lambda: nodes.kill("stage-1")  # noqa: E731
            replayed = await tokens(coordinator, "adapted-through", 6, lose, adapter="pirate")
            standby = nodes.workers["standby-0"]
            assert standby.runner is not None and standby.runner.stage.adapters is not None
            return base, reference, replayed, sorted(standby.runner.stage.adapters.named)

    base, reference, replayed, held = run(scenario)
    assert reference != base  # the adapter changes the answer
    assert replayed == reference
    assert held == ["pirate"]


def test_a_repartition_over_the_survivors_plans_for_the_stages_serving(
    tiny_model: Callable[..., Path],
) -> None:
    """Three stages, no standby; stage 1 dies and the two survivors share its layers. An
    explicit repartition then plans two stages (the file says three), completes, and serves
    the same tokens; budgets for three stages are refused before anything drains."""
    model = tiny_model("recovery-llama", TINY_LLAMA)
    config = read_model_config(model)

    async def scenario() -> tuple[list[int], list[int], str, str, ElasticState, int]:
        async with cluster_of(model, split=SPLIT3) as (nodes, coordinator):
            reference = await tokens(coordinator, "reference")
            await nodes.kill("stage-1")
            await wait_until(lambda: chain_ids(coordinator) == ["stage-0", "stage-2"])
            await wait_serving(coordinator)
            gate = GatedBackend(None, "tiny")
            gate.coordinator = coordinator
            driver = ElasticDriver(
                ElasticPolicy(enabled=True), plan_of(SPLIT3), profile_from_config(config), gate,
                float32_profile=profile_from_config(float32_config(config)), poll_s=0.02,
            )  # fmt: skip
            try:
                refused = driver.trigger(Trigger.EXPLICIT, stage_memory=[None, None, None])
                accepted = driver.trigger(Trigger.EXPLICIT)
                assert accepted["accepted"], accepted
                await driver.wait()
                after = await tokens(coordinator, "repartitioned")
                event = driver.last_event()
                assert event is not None
                return (reference, after, refused["message"], str(event["outcome"]),
                        driver.state, len(coordinator.plan or ()))  # fmt: skip
            finally:
                await driver.close()

    reference, after, refused, outcome, state, stages = run(scenario)
    assert refused == "3 memory budgets given for the 2 stages serving now; give one per stage"
    assert (outcome, state, stages) == ("completed", ElasticState.IDLE, 2)
    assert after == reference
