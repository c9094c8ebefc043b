"""The coordinator agent's admin controller: the cluster status document, drain and resume.

The document's shape is docs/admin-api.md's; the HTTP layer adds the health badge. Stage cards
come from each stage's own status report over the pipeline link, so "process alive" means the
stage answered just now, and "transport connected" that the coordinator's link to it is up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxppd.runtime.agent import Agent

ADMIN_HOLD = "admin"


class AgentAdmin:
    """Implements the HTTP layer's ``AdminController`` over a running coordinator agent."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    async def status(self) -> dict[str, Any]:
        agent = self.agent
        rt = agent.runtime
        backend = rt.backend
        target = rt.coordinator
        live = backend.coordinator if backend is not None else None
        reports: dict[str, dict[str, Any] | None] = {}
        if live is not None and live.connected:
            reports = await live.stage_reports()
        ready = live is not None and live.connected
        if ready:
            detail = "all stages connected"
        elif agent.last_reconcile_error:
            detail = agent.last_reconcile_error
        else:
            detail = "the pipeline is connecting"
        stages = []
        for index, stage in enumerate(target.stages if target is not None else ()):
            report = reports.get(stage.node_id)
            layers = None
            if report is not None and isinstance(report.get("layers"), list):
                start, end = report["layers"]
                layers = f"{start}-{end - 1}"
            budget = report.get("kv_budget_bytes") if report else None
            stages.append(
                {
                    "stage": index,
                    "node_id": stage.node_id,
                    "address": f"{stage.host}:{stage.port}",
                    "layers": layers,
                    "process_alive": report is not None,
                    "transport_connected": live is not None and live.link_alive(stage.node_id),
                    "in_flight": report.get("active_sequences") if report else None,
                    "kv_used_bytes": report.get("kv_used_bytes") if report else None,
                    # An unlimited budget is a huge sentinel on the stage; show it as null.
                    "kv_budget_bytes": budget if budget is not None and budget < 1 << 60 else None,
                    "elastic_state": report.get("elastic_state") if report else None,
                    "config_generation": report.get("config_generation") if report else None,
                    "last_reload_error": report.get("last_reload_error") if report else None,
                }
            )
        http = f"{target.http_host}:{target.http_port}" if target is not None else ""
        return {
            "cluster": agent.context.cluster.cluster.name if agent.context else "",
            "coordinator": {
                "node_id": agent.desired.node_id if agent.desired else "",
                "http_address": http,
                "ready": ready,
                "detail": detail,
                "admission": backend.admission if backend is not None else "draining",
                "in_flight": backend.in_flight if backend is not None else 0,
                "waiting": live.waiting if live is not None else 0,
                "config_generation": rt.generation or "",
                "last_reload_error": agent.last_reload_error,
                "elastic_state": "idle",
                "reload_failures": agent.reload_failures,
            },
            "stages": stages,
        }

    async def drain(self) -> dict[str, Any]:
        backend = self.agent.runtime.backend
        if backend is None:
            return {"admission": "draining", "in_flight": 0}
        backend.hold(ADMIN_HOLD, "the cluster is drained by an operator (mlxppctl drain)")
        return {"admission": backend.admission, "in_flight": backend.in_flight}

    async def resume(self) -> dict[str, Any]:
        backend = self.agent.runtime.backend
        if backend is None:
            return {"admission": "draining", "in_flight": 0}
        backend.release(ADMIN_HOLD)
        # Other holds (a reload under way) keep admission closed until they end.
        return {"admission": backend.admission, "in_flight": backend.in_flight}
