"""The agent's reconcile as a table: (desired, observed) -> actions, in order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxppd.core.agent.plan import (
    CoordinatorTarget,
    DesiredState,
    ObservedState,
    RebindStage,
    ReloadStage,
    ReplanCoordinator,
    RestartCoordinator,
    SetGeneration,
    StageAddress,
    StageTarget,
    StartCoordinator,
    StartStage,
    StopCoordinator,
    StopStage,
    UpdateKvBudget,
    UpdatePolicy,
    plan,
)
from mlxppd.core.config.cluster import ElasticPolicy
from mlxppd.core.layer_ranges import LayerRange

POLICY = ElasticPolicy()
STAGE = StageTarget("s0", 0, 2, LayerRange(0, 15), "10.0.0.2", 19001, "tcp")
COORD = CoordinatorTarget(
    "c",
    "0.0.0.0",
    8080,
    "tcp",
    (StageAddress("s0", "10.0.0.2", 19001), StageAddress("s1", "10.0.0.3", 19001)),
    (LayerRange(0, 15), LayerRange(15, 30)),
)
SPLIT_20 = (LayerRange(0, 20), LayerRange(20, 30))


def stage_node(stage: StageTarget = STAGE, gen: str = "g1") -> DesiredState:
    return DesiredState("s0", gen, POLICY, stage=stage)


def coord_node(coord: CoordinatorTarget = COORD, gen: str = "g1") -> DesiredState:
    return DesiredState("c", gen, POLICY, coordinator=coord)


def running(
    stage: StageTarget | None = None,
    coord: CoordinatorTarget | None = None,
    gen: str | None = "g1",
    connected: bool = True,
) -> ObservedState:
    return ObservedState(gen, POLICY, stage, coord, connected)


CASES = [
    # --- first start: nothing runs yet -------------------------------------------------------
    (
        "a stage node starts its worker",
        stage_node(),
        ObservedState(),
        [StartStage(STAGE), UpdatePolicy(POLICY), SetGeneration("g1")],
    ),
    (
        "the coordinator starts its pipeline and HTTP",
        coord_node(),
        ObservedState(),
        [StartCoordinator(COORD), UpdatePolicy(POLICY), SetGeneration("g1")],
    ),
    # --- steady state ---------------------------------------------------------------------------
    ("a converged stage does nothing", stage_node(), running(stage=STAGE), []),
    ("a converged coordinator does nothing", coord_node(), running(coord=COORD), []),
    # --- layer ranges change -------------------------------------------------------------------
    (
        "new layers reload the stage in place",
        stage_node(replace(STAGE, layers=LayerRange(0, 20)), gen="g2"),
        running(stage=STAGE),
        [ReloadStage(replace(STAGE, layers=LayerRange(0, 20))), SetGeneration("g2")],
    ),
    (
        "a new stage count reloads too",
        stage_node(replace(STAGE, num_stages=3, layers=LayerRange(0, 10)), gen="g2"),
        running(stage=STAGE),
        [ReloadStage(replace(STAGE, num_stages=3, layers=LayerRange(0, 10))), SetGeneration("g2")],
    ),
    (
        "new layers replan the coordinator (drain, wait for stages, resume)",
        coord_node(replace(COORD, layers=SPLIT_20), gen="g2"),
        running(coord=COORD),
        [ReplanCoordinator(replace(COORD, layers=SPLIT_20)), SetGeneration("g2")],
    ),
    # --- transport, addresses, budgets ---------------------------------------------------------
    (
        "a new transport rebinds the stage, keeping its layers",
        stage_node(replace(STAGE, transport="rdma"), gen="g2"),
        running(stage=STAGE),
        [RebindStage(replace(STAGE, transport="rdma")), SetGeneration("g2")],
    ),
    (
        "a new port rebinds the stage",
        stage_node(replace(STAGE, port=19002), gen="g2"),
        running(stage=STAGE),
        [RebindStage(replace(STAGE, port=19002)), SetGeneration("g2")],
    ),
    (
        "new layers and a new transport: reload, then rebind",
        stage_node(replace(STAGE, layers=LayerRange(0, 20), transport="rdma"), gen="g2"),
        running(stage=STAGE),
        [
            ReloadStage(replace(STAGE, layers=LayerRange(0, 20), transport="rdma")),
            RebindStage(replace(STAGE, layers=LayerRange(0, 20), transport="rdma")),
            SetGeneration("g2"),
        ],
    ),
    (
        "a new KV budget alone is applied in place",
        stage_node(replace(STAGE, kv_budget_bytes=1 << 30)),
        running(stage=STAGE),
        [UpdateKvBudget(replace(STAGE, kv_budget_bytes=1 << 30))],
    ),
    (
        "a new transport reconnects the coordinator's pipeline",
        coord_node(replace(COORD, transport="rdma"), gen="g2"),
        running(coord=COORD),
        [
            RestartCoordinator(
                replace(COORD, transport="rdma"), "the stages, transport or batching changed"
            ),
            SetGeneration("g2"),
        ],
    ),
    (
        "a moved stage reconnects the coordinator's pipeline",
        coord_node(replace(COORD, stages=COORD.stages[::-1])),
        running(coord=COORD),
        [
            RestartCoordinator(
                replace(COORD, stages=COORD.stages[::-1]),
                "the stages, transport or batching changed",
            )
        ],
    ),
    (
        "a new HTTP port restarts the coordinator's HTTP",
        coord_node(replace(COORD, http_port=9090)),
        running(coord=COORD),
        [RestartCoordinator(replace(COORD, http_port=9090), "the HTTP address or API key changed")],
    ),
    (
        "a lost stage link makes the coordinator reconnect",
        coord_node(),
        running(coord=COORD, connected=False),
        [RestartCoordinator(COORD, "a stage connection was lost")],
    ),
    (
        "a lost link with new layers: one reconnect covers both",
        coord_node(replace(COORD, layers=SPLIT_20), gen="g2"),
        running(coord=COORD, connected=False),
        [
            RestartCoordinator(replace(COORD, layers=SPLIT_20), "a stage connection was lost"),
            SetGeneration("g2"),
        ],
    ),
    # --- roles change ---------------------------------------------------------------------------
    (
        "a stage that becomes the coordinator stops its worker first",
        coord_node(gen="g2"),
        running(stage=STAGE),
        [
            StopStage("this node is no longer a stage"),
            StartCoordinator(COORD),
            SetGeneration("g2"),
        ],
    ),
    (
        "the coordinator that becomes a stage stops HTTP and its pipeline first",
        stage_node(gen="g2"),
        running(coord=COORD),
        [
            StopCoordinator("this node is no longer the coordinator"),
            StartStage(STAGE),
            SetGeneration("g2"),
        ],
    ),
    # --- policy and generation -----------------------------------------------------------------
    (
        "a new elastic policy is applied",
        DesiredState("s0", "g2", ElasticPolicy(enabled=True), stage=STAGE),
        running(stage=STAGE),
        [UpdatePolicy(ElasticPolicy(enabled=True)), SetGeneration("g2")],
    ),
    (
        "a comment-only edit just records the new generation",
        stage_node(gen="g2"),
        running(stage=STAGE),
        [SetGeneration("g2")],
    ),
]


@pytest.mark.parametrize(
    ("desired", "observed", "actions"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_plan(desired: DesiredState, observed: ObservedState, actions: list[object]) -> None:
    assert list(plan(desired, observed)) == actions


def test_plan_is_idempotent_once_applied() -> None:
    """Applying a plan's targets yields an observed state that plans nothing."""
    desired = coord_node(replace(COORD, layers=SPLIT_20), gen="g2")
    after = running(coord=desired.coordinator, gen="g2")
    assert plan(desired, after) == ()
