"""The agent's DNS-SD advertisement as a planned resource: advertised once the node's roles are
in place, again when what it says changes, taken down when mlxppd.toml turns it off."""

from __future__ import annotations

from dataclasses import replace

from mlxppd.core.agent.plan import (
    Advertise,
    AdvertTarget,
    ObservedState,
    SetGeneration,
    StartStage,
    StopAdvertising,
    UpdatePolicy,
    UpdateRoster,
    describe,
    plan,
)
from tests.support.agent_states import POLICY, ROSTER, STAGE, running, stage_node

ADVERT = AdvertTarget("s1", "lab", "10.0.0.3", 19002)


def test_a_new_node_advertises_after_its_roles_and_before_its_generation() -> None:
    desired = replace(stage_node(), advert=ADVERT)
    assert plan(desired, ObservedState()) == (
        UpdateRoster(ROSTER), StartStage(STAGE), UpdatePolicy(POLICY), Advertise(ADVERT),
        SetGeneration("g1"),
    )  # fmt: skip


def test_an_advertised_node_in_place_does_nothing() -> None:
    desired = replace(stage_node(), advert=ADVERT)
    observed = replace(running(STAGE), advert=ADVERT)
    assert plan(desired, observed) == ()


def test_a_new_address_or_name_advertises_again() -> None:
    moved = replace(ADVERT, host="10.0.0.9", port=19009)
    desired = replace(stage_node(), advert=moved)
    observed = replace(running(STAGE), advert=ADVERT)
    assert plan(desired, observed) == (Advertise(moved),)


def test_turning_it_off_stops_advertising() -> None:
    observed = replace(running(STAGE), advert=ADVERT)
    (action,) = plan(stage_node(), observed)
    assert isinstance(action, StopAdvertising) and "off" in action.reason


def test_the_log_line_names_the_node_and_where_it_advertises() -> None:
    assert describe(Advertise(ADVERT)) == "Advertise s1.lab on DNS-SD (10.0.0.3:19002)"
    assert describe(StopAdvertising("off")) == "StopAdvertising off"
