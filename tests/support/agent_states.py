"""Desired and observed states of an agent's node, for the reconcile tests.

A stage node ``s0`` (``STAGE``: stage 0 of 2, layers 0-14) and a coordinator node ``c``
(``COORD``: two stages at 10.0.0.2 and 10.0.0.3), both under the default elastic policy and
``ROSTER`` (the three nodes' test keys), which a running node already believes.
"""

from __future__ import annotations

from mlxppd.core.agent.plan import (
    CoordinatorTarget,
    DesiredState,
    ObservedState,
    StageAddress,
    StageTarget,
)
from mlxppd.core.config.cluster import ElasticPolicy
from mlxppd.core.config.roster import Roster
from mlxppd.core.layer_ranges import LayerRange
from tests.support.node_keys import roster_for

POLICY = ElasticPolicy()
ROSTER = roster_for(("c", "s0", "s1"))
STAGE = StageTarget("s0", 0, 2, LayerRange(0, 15), "10.0.0.2", 19001, "tcp")
COORD = CoordinatorTarget(
    "c",
    "0.0.0.0",
    8080,
    "tcp",
    (StageAddress("s0", "10.0.0.2", 19001), StageAddress("s1", "10.0.0.3", 19001)),
    (LayerRange(0, 15), LayerRange(15, 30)),
)


def stage_node(stage: StageTarget = STAGE, gen: str = "g1") -> DesiredState:
    """What node ``s0`` of generation ``gen`` is told to run: ``stage``."""
    return DesiredState("s0", gen, POLICY, stage=stage, roster=ROSTER)


def coord_node(coord: CoordinatorTarget = COORD, gen: str = "g1") -> DesiredState:
    """What node ``c`` of generation ``gen`` is told to run: ``coord``."""
    return DesiredState("c", gen, POLICY, coordinator=coord, roster=ROSTER)


def running(
    stage: StageTarget | None = None,
    coord: CoordinatorTarget | None = None,
    gen: str | None = "g1",
    connected: bool = True,
    roster: Roster = ROSTER,
) -> ObservedState:
    """What an agent sees running: ``stage`` and/or ``coord``, at generation ``gen``,
    believing ``roster``."""
    return ObservedState(gen, POLICY, stage, coord, connected, roster=roster)
