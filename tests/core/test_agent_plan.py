"""The agent's reconcile as a table: (desired, observed) -> actions, in order."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mlxppd.core.agent.desired import desired_state, match_node
from mlxppd.core.agent.plan import (
    Advertise,
    AdvertTarget,
    DesiredState,
    ObservedState,
    RebindStage,
    ReloadStage,
    ReplanCoordinator,
    RestartCoordinator,
    SetGeneration,
    StageTarget,
    StartCoordinator,
    StartStage,
    StopCoordinator,
    StopStage,
    UpdateKvBudget,
    UpdatePolicy,
    UpdateRoster,
    plan,
)
from mlxppd.core.config.cluster import ElasticPolicy, parse_cluster_config
from mlxppd.core.config.host import load_host_settings
from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.stages import STANDBY_INDEX
from tests.support.agent_states import (
    COORD,
    POLICY,
    ROSTER,
    STAGE,
    coord_node,
    running,
    stage_node,
)
from tests.support.cluster_toml import cluster_toml, grid_nodes
from tests.support.node_keys import roster_for, roster_toml

SPLIT_20 = (LayerRange(0, 20), LayerRange(20, 30))
# A standby node's worker: same path as a stage's, no layers of its own.
STANDBY = StageTarget("s0", STANDBY_INDEX, 2, None, "10.0.0.2", 19001, "tcp")


CASES = [
    # --- first start: nothing runs yet -------------------------------------------------------
    (
        "a stage node starts its worker",
        stage_node(),
        ObservedState(),
        [UpdateRoster(ROSTER), StartStage(STAGE), UpdatePolicy(POLICY), SetGeneration("g1")],
    ),
    (
        "the coordinator starts its pipeline and HTTP",
        coord_node(),
        ObservedState(),
        [UpdateRoster(ROSTER), StartCoordinator(COORD), UpdatePolicy(POLICY), SetGeneration("g1")],
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
    # --- standby nodes -------------------------------------------------------------------------
    (
        "a standby node starts its (empty) worker",
        stage_node(STANDBY),
        ObservedState(),
        [UpdateRoster(ROSTER), StartStage(STANDBY), UpdatePolicy(POLICY), SetGeneration("g1")],
    ),
    # Its layers are the coordinator's to give: whatever it adopted, nothing is undone.
    ("an unchanged standby does nothing", stage_node(STANDBY), running(stage=STANDBY), []),
    (
        "an unchanged standby under a new generation only records it",
        stage_node(STANDBY, gen="g2"),
        running(stage=STANDBY),
        [SetGeneration("g2")],
    ),
    (
        "a stage that becomes a standby stops and starts again",
        stage_node(STANDBY, gen="g2"),
        running(stage=STAGE),
        [
            StopStage("this node's role changed from pipeline_stage to standby"),
            StartStage(STANDBY),
            SetGeneration("g2"),
        ],
    ),
    (
        "a standby that becomes a stage stops and starts again",
        stage_node(gen="g2"),
        running(stage=STANDBY),
        [
            StopStage("this node's role changed from standby to pipeline_stage"),
            StartStage(STAGE),
            SetGeneration("g2"),
        ],
    ),
    (
        "a standby that becomes the coordinator stops its worker first",
        coord_node(gen="g2"),
        running(stage=STANDBY),
        [
            StopStage("this node is no longer a stage"),
            StartCoordinator(COORD),
            SetGeneration("g2"),
        ],
    ),
    (
        "a new port rebinds a standby in place (what it adopted stays)",
        stage_node(replace(STANDBY, port=19002), gen="g2"),
        running(stage=STANDBY),
        [RebindStage(replace(STANDBY, port=19002)), SetGeneration("g2")],
    ),
    (
        "a new KV budget is applied to a standby in place",
        stage_node(replace(STANDBY, kv_budget_bytes=1 << 30)),
        running(stage=STANDBY),
        [UpdateKvBudget(replace(STANDBY, kv_budget_bytes=1 << 30))],
    ),
    (
        "a new weight mode restarts a standby: it never reloads",
        stage_node(replace(STANDBY, cpu_weights=CpuWeights.FLOAT32), gen="g2"),
        running(stage=STANDBY),
        [
            StopStage("the standby's stage count or weight mode changed"),
            StartStage(replace(STANDBY, cpu_weights=CpuWeights.FLOAT32)),
            SetGeneration("g2"),
        ],
    ),
    (
        "a new stage count restarts a standby",
        stage_node(replace(STANDBY, num_stages=3), gen="g2"),
        running(stage=STANDBY),
        [
            StopStage("the standby's stage count or weight mode changed"),
            StartStage(replace(STANDBY, num_stages=3)),
            SetGeneration("g2"),
        ],
    ),
    # --- policy and generation -----------------------------------------------------------------
    (
        "a new elastic policy is applied",
        DesiredState("s0", "g2", ElasticPolicy(enabled=True), stage=STAGE, roster=ROSTER),
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


# -- the roster: after the stops, before the starts -----------------------------------------------

#: ``ROSTER`` with node ``s1``'s line removed (the operator revoked it)
WITHOUT_S1 = roster_for(("c", "s0"))


def test_a_removed_roster_line_updates_the_roster_alone() -> None:
    desired = replace(coord_node(gen="g2"), roster=WITHOUT_S1)
    assert plan(desired, running(coord=COORD)) == (UpdateRoster(WITHOUT_S1), SetGeneration("g2"))


def test_the_new_roster_comes_after_the_stops_and_before_the_starts() -> None:
    # The coordinator becomes a stage under a new roster: its pipeline's links go first, the
    # worker it starts then accepts only the keys the new roster lists.
    desired = replace(stage_node(gen="g2"), roster=WITHOUT_S1)
    assert plan(desired, running(coord=COORD)) == (
        StopCoordinator("this node is no longer the coordinator"),
        UpdateRoster(WITHOUT_S1),
        StartStage(STAGE),
        SetGeneration("g2"),
    )


def test_a_reload_or_rebind_under_a_new_roster_uses_the_new_one() -> None:
    moved = replace(STAGE, layers=LayerRange(0, 20), port=19002)
    desired = replace(stage_node(moved, gen="g2"), roster=WITHOUT_S1)
    actions = plan(desired, running(stage=STAGE))
    assert actions[0] == UpdateRoster(WITHOUT_S1)
    assert [type(a) for a in actions[1:]] == [ReloadStage, RebindStage, SetGeneration], actions


def test_an_unchanged_roster_plans_no_update() -> None:
    for desired, observed in [
        (stage_node(gen="g2"), running(stage=STAGE)),
        (coord_node(replace(COORD, layers=SPLIT_20), gen="g2"), running(coord=COORD)),
        (stage_node(gen="g2"), running(coord=COORD)),  # a role change, the same keys
    ]:
        actions = plan(desired, observed)
        assert not any(isinstance(a, UpdateRoster) for a in actions), actions


def test_a_node_believing_no_roster_yet_takes_the_files_first() -> None:
    actions = plan(stage_node(), ObservedState())
    assert actions[0] == UpdateRoster(ROSTER)


def test_a_standby_target_has_no_layers_and_a_stage_target_has_some() -> None:
    assert STANDBY.standby and not STAGE.standby
    with pytest.raises(ValueError, match="layers exactly when it is not a standby"):
        StageTarget("s0", STANDBY_INDEX, 2, LayerRange(0, 15), "10.0.0.2", 19001, "tcp")
    with pytest.raises(ValueError, match="layers exactly when it is not a standby"):
        StageTarget("s0", 0, 2, None, "10.0.0.2", 19001, "tcp")


# -- a standby node's desired state -------------------------------------------------------------

MODEL = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}

CLUSTER = """\
[cluster]
pipeline_parallel_size = 2
kv_budget_bytes = 1000
cpu_weights = "native"

[[nodes]]
id = "coordinator"
address = "10.0.0.1:19000"
role = "hybrid"

[[nodes]]
id = "stage-0"
address = "10.0.0.2:19001"
role = "pipeline_stage"
stage = 0

[[nodes]]
id = "stage-1"
address = "10.0.0.3:19001"
role = "pipeline_stage"
stage = 1

[[nodes]]
id = "spare"
address = "10.0.0.4:19002"
role = "standby"
""" + roster_toml(["coordinator", "stage-0", "stage-1", "spare"])


def _desired(tmp_path: Path, node_id: str, cluster: str = CLUSTER) -> DesiredState:
    cfg = parse_cluster_config(cluster, "cluster.toml")
    host = load_host_settings(tmp_path, environ={})
    return desired_state(cfg, host, match_node(cfg, node_id, bool), MODEL, "g1")


def test_a_standby_node_wants_a_worker_with_no_layers(tmp_path: Path) -> None:
    desired = _desired(tmp_path, "spare")
    assert desired.coordinator is None
    assert desired.stage == StageTarget(
        "spare",
        STANDBY_INDEX,
        2,
        None,
        "10.0.0.4",
        19002,
        "tcp",
        kv_budget_bytes=1000,
        cpu_weights=CpuWeights.NATIVE,
    )
    assert desired.advert == AdvertTarget("spare", "mlxpp-cluster", "10.0.0.4", 19002)
    assert plan(desired, ObservedState()) == (
        UpdateRoster(desired.roster),
        StartStage(desired.stage),
        UpdatePolicy(desired.policy),
        Advertise(desired.advert),
        SetGeneration("g1"),
    )


def test_the_coordinator_and_stages_do_not_count_the_standby(tmp_path: Path) -> None:
    coordinator = _desired(tmp_path, "coordinator").coordinator
    assert coordinator is not None
    assert [s.node_id for s in coordinator.stages] == ["stage-0", "stage-1"]
    assert coordinator.layers == (LayerRange(0, 15), LayerRange(15, 30))
    stage = _desired(tmp_path, "stage-1").stage
    assert stage is not None and (stage.stage, stage.num_stages) == (1, 2)


def test_a_role_edit_from_stage_to_standby_restarts_the_worker(tmp_path: Path) -> None:
    before = _desired(tmp_path, "stage-1")
    # The operator swaps the two: stage-1 becomes the standby and the spare serves stage 1.
    swaps = {
        'role = "pipeline_stage"\nstage = 1': 'role = "standby"',
        '19002"\nrole = "standby"': '19002"\nrole = "pipeline_stage"\nstage = 1',
    }
    edited = CLUSTER
    for old, new in swaps.items():
        assert edited.count(old) == 1
        edited = edited.replace(old, new)
    after = _desired(tmp_path, "stage-1", edited)
    assert before.stage is not None and after.stage is not None and after.stage.standby
    advertised = {"advert": before.advert}  # the node id and address stay: so does its advert
    was = replace(running(stage=before.stage, roster=before.roster), **advertised)
    assert plan(after, was) == (
        StopStage("this node's role changed from pipeline_stage to standby"),
        StartStage(after.stage),
    )
    # Applied, the standby plans nothing more on later passes.
    now = replace(running(stage=after.stage, roster=after.roster), **advertised)
    assert plan(after, now) == ()


# -- a tensor-parallel rank --------------------------------------------------------------------

RANK_1 = replace(
    STAGE,
    node_id="s0-r1",
    tp_rank=1,
    tp_ring=("10.0.0.2:19002", "10.0.0.5:19002"),
    tp_nodes=("s0", "s0-r1"),
    tp_addresses=("10.0.0.2:19001", "10.0.0.5:19001"),
)


def test_a_tensor_parallel_stage_restarts_rather_than_changing_in_place() -> None:
    # Its ranks shard the layers together: a new budget (in place for a stage of one rank)
    # starts the rank again.
    wanted = replace(RANK_1, kv_budget_bytes=1 << 20)
    assert plan(stage_node(wanted), running(stage=RANK_1))[:2] == (
        StopStage("a tensor-parallel stage's settings changed; its ranks start again together"),
        StartStage(wanted),
    )
    assert plan(stage_node(RANK_1), running(stage=RANK_1)) == ()


def test_a_stage_that_lost_a_rank_starts_again() -> None:
    lost = ObservedState("g1", POLICY, RANK_1, None, True, ring_lost=True, roster=ROSTER)
    assert plan(stage_node(RANK_1), lost) == (
        StopStage("a tensor-parallel rank of this stage was lost"),
        StartStage(RANK_1),
    )


def test_a_2d_toml_gives_each_rank_its_ring(tmp_path: Path) -> None:
    cluster = parse_cluster_config(cluster_toml({"tensor_parallel_size": 2}, grid_nodes()), "t")
    host = load_host_settings(tmp_path, environ={})
    node = cluster.find_node("s1-r1")
    assert node is not None
    config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256}  # fmt: skip
    stage = desired_state(cluster, host, node, config, "g1").stage
    assert stage is not None
    assert (stage.stage, stage.tp_rank, stage.tp_nodes) == (1, 1, ("s1-r0", "s1-r1"))
    assert stage.tp_ring == ("10.0.2.1:8081", "10.0.2.2:8081")
    coordinator = desired_state(cluster, host, cluster.coordinator, config, "g1").coordinator
    assert coordinator is not None
    assert [s.node_id for s in coordinator.stages] == ["s0-r0", "s1-r0"]
