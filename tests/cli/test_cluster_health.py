"""The cluster's health badge and its one-sentence reason, from the status document."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from mlxppd.core.agent.health import overall_health

MiB = 1024 * 1024


def document() -> dict[str, Any]:
    """A healthy two-stage cluster, as the admin API describes it."""
    return {
        "cluster": "mlxpp-cluster",
        "coordinator": {
            "node_id": "coordinator",
            "http_address": "192.168.1.10:8080",
            "ready": True,
            "detail": "2 stages connected",
            "admission": "open",
            "in_flight": 0,
            "waiting": 0,
            "config_generation": "g1",
            "last_reload_error": None,
            "elastic_state": "idle",
            "reload_failures": 0,
        },
        "stages": [
            {
                "stage": i,
                "node_id": f"stage-{i}",
                "address": f"192.168.1.1{i + 1}:19001",
                "layers": ["0-14", "15-29"][i],
                "process_alive": True,
                "transport_connected": True,
                "in_flight": 0,
                "kv_used_bytes": 10 * MiB,
                "kv_budget_bytes": 100 * MiB,
                "elastic_state": "idle",
                "config_generation": "g1",
                "last_reload_error": None,
            }
            for i in range(2)
        ],
    }


def coordinator(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["coordinator"].update(fields)


def stage(index: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["stages"][index].update(fields)


def dead_stage(index: int) -> Callable[[dict[str, Any]], None]:
    nulls = dict.fromkeys(
        (
            "in_flight",
            "kv_used_bytes",
            "kv_budget_bytes",
            "elastic_state",
            "config_generation",
            "last_reload_error",
        )
    )
    return stage(index, process_alive=False, transport_connected=False, **nulls)


def no_stages(doc: dict[str, Any]) -> None:
    doc["stages"] = []


def one_stage(doc: dict[str, Any]) -> None:
    del doc["stages"][1]


def both(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        for change in changes:
            change(doc)

    return apply


CASES: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("nothing wrong", lambda doc: None, "healthy", "all 2 stages connected"),
    ("one stage", one_stage, "healthy", "the only stage is connected"),
    ("no budget is unlimited", stage(0, kv_budget_bytes=None), "healthy", "all 2 stages connected"),
    (
        "KV just under the threshold",
        stage(1, kv_used_bytes=91 * MiB),
        "healthy",
        "all 2 stages connected",
    ),
    (
        "a live stage that cannot say its generation",
        stage(0, config_generation=None),
        "healthy",
        "all 2 stages connected",
    ),
    # unhealthy
    (
        "coordinator not ready",
        coordinator(ready=False, detail="stage 1 is warming up"),
        "unhealthy",
        "the coordinator is not ready: stage 1 is warming up",
    ),
    ("no stages", no_stages, "unhealthy", "the coordinator knows no pipeline stages"),
    ("stage process dead", dead_stage(1), "unhealthy", "stage 1 (stage-1) is not running"),
    (
        "stage not connected",
        stage(1, transport_connected=False),
        "unhealthy",
        "stage 1 (stage-1) is not connected",
    ),
    (
        "unhealthy wins over degraded",
        both(coordinator(admission="draining"), stage(0, transport_connected=False)),
        "unhealthy",
        "stage 0 (stage-0) is not connected",
    ),
    # degraded
    ("draining", coordinator(admission="draining"), "degraded", "admission is draining"),
    (
        "coordinator reload failed",
        coordinator(last_reload_error="cluster.toml line 3: bad key"),
        "degraded",
        "coordinator: last reload failed: cluster.toml line 3: bad key",
    ),
    (
        "stage reload failed",
        stage(0, last_reload_error="model not found"),
        "degraded",
        "stage-0: last reload failed: model not found",
    ),
    (
        "config generation mismatch",
        stage(1, config_generation="g0"),
        "degraded",
        "stage 1 (stage-1) runs config generation g0, the coordinator g1",
    ),
    (
        "coordinator repartitioning",
        coordinator(elastic_state="draining"),
        "degraded",
        "elastic repartitioning is draining",
    ),
    (
        "stage repartitioning",
        stage(0, elastic_state="loading"),
        "degraded",
        "stage 0 (stage-0) elastic state is loading",
    ),
    (
        "KV at the threshold",
        stage(1, kv_used_bytes=92 * MiB),
        "degraded",
        "stage 1 (stage-1) KV cache is 92% full",
    ),
    (
        "the first reason is named",
        both(coordinator(admission="draining"), stage(1, kv_used_bytes=99 * MiB)),
        "degraded",
        "admission is draining",
    ),
]


@pytest.mark.parametrize(
    ("change", "badge", "detail"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_badge_and_detail(
    change: Callable[[dict[str, Any]], None], badge: str, detail: str
) -> None:
    doc = document()
    change(doc)
    before = copy.deepcopy(doc)
    assert overall_health(doc) == (badge, detail)
    assert doc == before  # pure: the document is not touched


@pytest.mark.parametrize(
    "doc",
    [{}, {"coordinator": None, "stages": None}, {"coordinator": {"ready": True}, "stages": "x"}],
)
def test_a_broken_document_is_unhealthy_not_an_exception(doc: dict[str, Any]) -> None:
    assert overall_health(doc)[0] == "unhealthy"
