"""The coordinator's admin controller: the cluster status document, drain, resume, repartition.

The document is the frozen model of ``mlxppd/core/status_document.py`` (docs/admin-api.md says
what it means); the HTTP layer adds the health badge and serves its JSON. Stage cards
come from each stage's own status report over the pipeline link, so "process alive" means the
stage answered just now, and "transport connected" that the coordinator's link to it is up.
Standby nodes get cards of their own: no layers until the coordinator gives one a lost stage's,
then that stage and its layers (read from the standby's report once it is in the pipeline).
The same controller serves the agent's coordinator and ``mlxppd serve``'s (``CoordinatorView``
says where each piece of information comes from).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from mlxppd.core.agent.elastic import ElasticState, Trigger
from mlxppd.core.agent.plan import StageAddress
from mlxppd.core.errors import MlxppError
from mlxppd.core.kv_admission import configured_budget
from mlxppd.core.model_identity import IdentityCheck
from mlxppd.core.protocol.control import StageReport
from mlxppd.core.status_document import (
    AdapterStatus,
    ClusterStatus,
    CoordinatorStatus,
    FailoverRecord,
    IdentityStatus,
    NamedAdapter,
    NodeCard,
    PrepareStatus,
    RepartitionEventRecord,
    RepartitionEvents,
    SlotStatus,
    StageCard,
)
from mlxppd.runtime.coordinator.elastic_driver import ElasticDriver
from mlxppd.runtime.coordinator.gate import GatedBackend

if TYPE_CHECKING:
    from mlxppd.runtime.agent.loop import Agent

ADMIN_HOLD = "admin"
Role = Literal["pipeline_stage", "standby"]
Card = TypeVar("Card", bound=NodeCard)


@dataclass
class CoordinatorView:
    """Where the admin controller reads from; callables, since the parts are replaced live."""

    cluster_name: Callable[[], str]
    node_id: Callable[[], str]
    gate: Callable[[], GatedBackend | None]
    stages: Callable[[], Sequence[StageAddress]]
    http_address: Callable[[], str]
    driver: Callable[[], ElasticDriver | None]
    generation: Callable[[], str] = lambda: ""
    last_reload_error: Callable[[], str | None] = lambda: None
    last_error: Callable[[], str | None] = lambda: None
    reload_failures: Callable[[], int] = lambda: 0
    standbys: Callable[[], Sequence[StageAddress]] = lambda: ()
    #: the pre-launch warnings of the plan in force (mlxppd/core/partition/launch.py)
    warnings: Callable[[], Sequence[str]] = lambda: ()
    #: the last identity check of every stage when the pipeline is not up (a refused one)
    identity: Callable[[], Sequence[IdentityCheck]] = lambda: ()
    #: the last prepare's progress (None: none ran), and how to start one (None: cannot)
    prepare_status: Callable[[], PrepareStatus | None] = lambda: None
    prepare: Callable[[float | None, list[str] | None], dict[str, Any]] | None = None


class CoordinatorAdmin:
    """Implements the HTTP layer's ``AdminController``."""

    def __init__(self, view: CoordinatorView) -> None:
        self.view = view

    async def status(self) -> ClusterStatus:
        view = self.view
        gate = view.gate()
        live = gate.coordinator if gate is not None else None
        reports: dict[str, StageReport | None] = {}
        ready = live is not None and live.connected
        if live is not None and ready:
            reports = await live.stage_reports()
        return ClusterStatus(
            cluster=view.cluster_name(),
            coordinator=_coordinator(view, gate, live, ready),
            stages=_stage_cards(view, live, reports),
            standbys=tuple(_standby_card(s, reports.get(s.node_id), live) for s in view.standbys()),
        )

    async def drain(self) -> dict[str, Any]:
        gate = self.view.gate()
        if gate is None:
            return {"admission": "draining", "in_flight": 0}
        gate.hold(ADMIN_HOLD, "the cluster is drained by an operator (mlxppctl drain)")
        return {"admission": gate.admission, "in_flight": gate.in_flight}

    async def resume(self) -> dict[str, Any]:
        gate = self.view.gate()
        if gate is None:
            return {"admission": "draining", "in_flight": 0}
        gate.release(ADMIN_HOLD)
        # Other holds (a reload under way) keep admission closed until they end.
        return {"admission": gate.admission, "in_flight": gate.in_flight}

    async def repartition(
        self, stage_memory: list[int | None] | None, pp_layers: str | None
    ) -> dict[str, Any]:
        driver = self.view.driver()
        if driver is None:
            return {
                "accepted": False,
                "reason": "disabled",
                "message": "this coordinator has no pipeline to repartition yet",
            }
        return driver.trigger(Trigger.EXPLICIT, stage_memory=stage_memory, pp_layers=pp_layers)

    async def prepare(
        self, max_rate_bytes_s: float | None, nodes: list[str] | None
    ) -> dict[str, Any]:
        if self.view.prepare is None:
            return {
                "accepted": False,
                "reason": "unsupported",
                "message": "this coordinator does not ship models (run it under mlxppd agent)",
            }
        return self.view.prepare(max_rate_bytes_s, nodes)

    async def adapter_load(self, name: str, path: str) -> dict[str, Any]:
        return await self._adapter(lambda live: live.load_adapter(name, path))

    async def adapter_unload(self, name: str, drain_timeout_s: float) -> dict[str, Any]:
        return await self._adapter(lambda live: live.unload_adapter(name, drain_timeout_s))

    async def _adapter(self, change: Callable[[Any], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        gate = self.view.gate()
        live = gate.coordinator if gate is not None else None
        if live is None or not live.connected:
            return {
                "accepted": False,
                "reason": "unavailable",
                "message": "the pipeline is not connected; try again once it serves",
            }
        try:
            return {"accepted": True, **await change(live)}
        except (MlxppError, OSError, ValueError, KeyError, TypeError) as exc:
            # A file that cannot be read or parsed is this request's failure, said in full.
            return {"accepted": False, "reason": "refused", "message": str(exc) or repr(exc)}

    async def events(self, after: int) -> RepartitionEvents:
        driver = self.view.driver()
        if driver is None:
            return RepartitionEvents(state=ElasticState.IDLE, events=())
        events = tuple(RepartitionEventRecord.model_validate(e) for e in driver.events_after(after))
        return RepartitionEvents(state=driver.state, events=events)


def _coordinator(
    view: CoordinatorView, gate: GatedBackend | None, live: Any, ready: bool
) -> CoordinatorStatus:
    driver = view.driver()
    registry = getattr(live, "adapters", None)
    # Keys that do not apply to this coordinator are left out (MISSING), not sent as null.
    optional: dict[str, Any] = {}
    if registry is not None:
        optional["adapters"] = AdapterStatus(
            fused=str(registry.fused) if registry.fused is not None else None,
            named={
                n: NamedAdapter(path=str(registry.path(n)), running=running)
                for n, running in registry.usage().items()
            },
        )
    if driver is not None:
        event = driver.last_event()
        optional["elastic_enabled"] = driver.machine.policy.enabled
        optional["last_repartition_event"] = (
            RepartitionEventRecord.model_validate(event) if event is not None else None
        )
        optional["last_repartition_loads"] = tuple(driver.last_loads)
    detail = "all stages connected" if ready else view.last_error() or "the pipeline is connecting"
    failovers = [FailoverRecord(**asdict(e)) for e in live.failovers] if live is not None else []
    return CoordinatorStatus(
        node_id=view.node_id(),
        http_address=view.http_address(),
        ready=ready,
        detail=detail,
        admission=gate.admission if gate is not None else "draining",
        in_flight=gate.in_flight if gate is not None else 0,
        waiting=live.waiting if live is not None else 0,
        transport=live.transport.backend if live is not None else None,
        config_generation=view.generation(),
        last_reload_error=view.last_reload_error(),
        elastic_state=driver.state if driver is not None else ElasticState.IDLE,
        reload_failures=view.reload_failures(),
        failovers=tuple(failovers),
        warnings=tuple(view.warnings()),
        prepare=view.prepare_status(),
        **optional,
    )


def _stage_cards(
    view: CoordinatorView, live: Any, reports: dict[str, StageReport | None]
) -> tuple[StageCard, ...]:
    # After a failover the chain is no longer the file's: show the one serving.
    chain = live.chain_nodes() if live is not None else []
    nodes = [StageAddress(n.id, n.host, n.port) for n in chain] or list(view.stages())
    spares = {s.node_id for s in view.standbys()}
    checks = {c.node: c for c in (live.identity_checks if live else None) or view.identity()}
    # Down or recovering, the stages were not asked (or their links were dropped for a new
    # pipeline): only those whose link failed are known to be down.
    asked = live is not None and live.health().ready
    lost: set[str] = live.lost_nodes if live is not None else set()
    cards = []
    for i, node in enumerate(nodes):
        report = reports.get(node.node_id)
        alive = (report is not None) if asked else (False if node.node_id in lost else None)
        role: Role = "standby" if node.node_id in spares else "pipeline_stage"
        identity = _identity(checks.get(node.node_id))
        cards.append(_node_card(StageCard, i, node, role, alive, live, report, identity=identity))
    return tuple(cards)


def _standby_card(node: StageAddress, report: StageReport | None, live: Any) -> NodeCard:
    """A standby: no stage and no layers, or the lost stage's once it adopted them. The
    coordinator links to a standby only once it is in the pipeline, so without a report its
    process is unknown (null), not dead."""
    adopted = report.stage if report is not None and report.stage >= 0 else None
    alive = True if report is not None else None
    return _node_card(NodeCard, adopted, node, "standby", alive, live, report)


def _node_card(
    cls: type[Card],
    stage: int | None,
    node: StageAddress,
    role: Role,
    alive: bool | None,
    live: Any,
    report: StageReport | None,
    **more: Any,
) -> Card:
    """A card: where the node is, then what its own report says (null for all of that when
    it did not answer); ``layers`` is null for a node holding none (a standby)."""
    r = report
    layers = None if r is None or r.layers[1] <= r.layers[0] else f"{r.layers[0]}-{r.layers[1] - 1}"
    return cls(
        stage=stage,
        node_id=node.node_id,
        address=f"{node.host}:{node.port}",
        role=role,
        layers=layers,
        process_alive=alive,
        transport_connected=live is not None and live.link_alive(node.node_id),
        in_flight=r.active_sequences if r else None,
        kv_used_bytes=r.kv_used_bytes if r else None,
        kv_budget_bytes=configured_budget(r.kv_budget_bytes) if r else None,
        elastic_state=r.elastic_state if r else None,
        config_generation=r.config_generation if r else None,
        last_reload_error=r.last_reload_error if r else None,
        memory_budget_bytes=r.memory_budget_bytes if r else None,
        weights=r.weights if r else None,
        blas=r.blas if r else None,
        parameter_bytes=r.parameter_bytes if r else None,
        # A tensor-parallel stage: each (stage, rank) slot's shard and KV.
        slots=tuple(
            SlotStatus(
                rank=slot.rank,
                node_id=slot.node_id,
                parameter_bytes=slot.parameter_bytes,
                kv_used_bytes=slot.kv_used_bytes,
                kv_budget_bytes=configured_budget(slot.kv_budget_bytes),
            )
            for slot in (r.slots if r else ())
        ),
        **more,
    )


def _identity(check: IdentityCheck | None) -> IdentityStatus | None:
    """A stage's model identity as the coordinator last found it (null: not checked)."""
    if check is None:
        return None
    return IdentityStatus(
        state=check.state,
        detail=check.detail,
        expected_sha256=check.expected.tensors_sha256 if check.expected else None,
        actual_sha256=check.actual.tensors_sha256 if check.actual else None,
    )


def agent_admin(agent: Agent) -> CoordinatorAdmin:
    """The controller of an agent's coordinator."""
    rt = agent.runtime

    def http() -> str:
        target = rt.coordinator
        return f"{target.http_host}:{target.http_port}" if target is not None else ""

    return CoordinatorAdmin(
        CoordinatorView(
            cluster_name=lambda: agent.context.cluster.cluster.name if agent.context else "",
            node_id=lambda: agent.desired.node_id if agent.desired else "",
            gate=lambda: rt.backend,
            stages=lambda: rt.coordinator.stages if rt.coordinator is not None else (),
            http_address=http,
            driver=lambda: rt.driver,
            generation=lambda: rt.generation or "",
            last_reload_error=lambda: agent.last_reload_error,
            last_error=lambda: agent.last_reconcile_error,
            reload_failures=lambda: agent.reload_failures,
            standbys=lambda: _standbys(agent),
            warnings=lambda: rt.partition_warnings,
            identity=lambda: rt.identity_checks,
            prepare_status=rt.preparer.status,
            prepare=lambda rate, nodes: _prepare(agent, rate, nodes),
        )
    )


def _prepare(agent: Agent, rate: float | None, nodes: list[str] | None) -> dict[str, Any]:
    if agent.context is None:
        return {"accepted": False, "reason": "starting", "message": "no configuration yet"}
    wanted = set(nodes) if nodes else None
    return agent.runtime.start_prepare(agent.context, nodes=wanted, max_rate_bytes_s=rate)


def _standbys(agent: Agent) -> tuple[StageAddress, ...]:
    """The standby nodes of the configuration in force (none before one loads)."""
    if agent.context is None:
        return ()
    nodes = agent.context.cluster.standby_nodes()
    return tuple(StageAddress(n.id, n.host, n.port) for n in nodes)
