"""One word and one sentence for the whole cluster, from the coordinator's status document.

``overall_health`` reads the document the admin API serves (see docs/admin-api.md) and says
"healthy", "degraded" (serving, but something needs a look) or "unhealthy" (not serving).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["DEGRADED", "HEALTHY", "KV_PRESSURE_FRACTION", "UNHEALTHY", "overall_health"]

HEALTHY: Final = "healthy"
DEGRADED: Final = "degraded"
UNHEALTHY: Final = "unhealthy"
#: a stage whose KV cache is at least this full is a warning (the elastic pressure default)
KV_PRESSURE_FRACTION: Final = 0.92


def _stage_name(stage: Mapping[str, Any]) -> str:
    return f"stage {stage.get('stage', '?')} ({stage.get('node_id') or 'unknown node'})"


def _stages(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    stages = status.get("stages")
    if not isinstance(stages, Sequence) or isinstance(stages, str):
        return []
    return [s for s in stages if isinstance(s, Mapping)]


def _unhealthy(coordinator: Mapping[str, Any], stages: list[Mapping[str, Any]]) -> str | None:
    if coordinator.get("ready") is not True:
        detail = coordinator.get("detail")
        return "the coordinator is not ready" + (f": {detail}" if detail else "")
    if not stages:
        return "the coordinator knows no pipeline stages"
    for stage in stages:
        if stage.get("process_alive") is None:
            return f"{_stage_name(stage)} did not answer"
        if stage.get("process_alive") is not True:
            return f"{_stage_name(stage)} is not running"
        if stage.get("transport_connected") is not True:
            return f"{_stage_name(stage)} is not connected"
    return None


def _kv_fraction(stage: Mapping[str, Any]) -> float | None:
    used, budget = stage.get("kv_used_bytes"), stage.get("kv_budget_bytes")
    if not isinstance(used, int) or not isinstance(budget, int) or budget <= 0:
        return None  # unknown, or no budget (unlimited)
    return used / budget


def _degraded(coordinator: Mapping[str, Any], stages: list[Mapping[str, Any]]) -> str | None:
    admission = coordinator.get("admission")
    if admission != "open":
        return f"admission is {admission or 'unknown'}"
    if coordinator.get("last_reload_error"):
        name = coordinator.get("node_id") or "coordinator"
        return f"{name}: last reload failed: {coordinator['last_reload_error']}"
    for stage in stages:
        if stage.get("last_reload_error"):
            name = stage.get("node_id") or _stage_name(stage)
            return f"{name}: last reload failed: {stage['last_reload_error']}"
    generation = coordinator.get("config_generation")
    for stage in stages:
        # A stage that cannot say (null) is not counted as different.
        theirs = stage.get("config_generation")
        if theirs is not None and theirs != generation:
            return (
                f"{_stage_name(stage)} runs config generation {theirs}, "
                f"the coordinator {generation}"
            )
    elastic = coordinator.get("elastic_state")
    if elastic is not None and elastic != "idle":
        return f"elastic repartitioning is {elastic}"
    for stage in stages:
        state = stage.get("elastic_state")
        if state is not None and state != "idle":
            return f"{_stage_name(stage)} elastic state is {state}"
    for stage in stages:
        fraction = _kv_fraction(stage)
        if fraction is not None and fraction >= KV_PRESSURE_FRACTION:
            return f"{_stage_name(stage)} KV cache is {fraction:.0%} full"
    return None


def overall_health(status: Mapping[str, Any]) -> tuple[str, str]:
    """(badge, detail): the badge is healthy, degraded or unhealthy; the detail says why,
    naming the first problem found (unhealthy reasons before degraded ones)."""
    raw = status.get("coordinator")
    coordinator: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    stages = _stages(status)
    if (reason := _unhealthy(coordinator, stages)) is not None:
        return UNHEALTHY, reason
    if (reason := _degraded(coordinator, stages)) is not None:
        return DEGRADED, reason
    if len(stages) == 1:
        return HEALTHY, "the only stage is connected"
    return HEALTHY, f"all {len(stages)} stages connected"
