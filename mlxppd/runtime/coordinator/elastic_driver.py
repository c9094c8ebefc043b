"""The elastic repartition driver: walks ``core.elastic``'s state machine on a live pipeline.

Draining: admissions held at the coordinator's gate and on every stage; the driver polls until
nothing is in flight (or the drain timeout: Failed). Rebalancing: the partitioner over each
stage's memory budget and the model's adjacency groups (or the operator's ``--pp-layers``).
Resuming: every stage loads the layers it gains beside the old ones (prepare), then all switch
(commit); one failure aborts all, so the previous ranges keep serving. Every transition is an
event: logged, counted in the repartition metrics, kept for ``mlxppctl repartition --wait``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from mlxppd.core.agent.elastic import (
    ElasticMachine,
    ElasticState,
    Rejection,
    RepartitionEvent,
    Trigger,
    begin,
    drained,
    fail,
    planned,
    pressured_stage,
    resumed,
)
from mlxppd.core.config.cluster import ElasticPolicy
from mlxppd.core.errors import MlxppError
from mlxppd.core.kv_admission import configured_budget
from mlxppd.core.layer_ranges import LayerRange, parse_pp_layers
from mlxppd.core.partition.plan import balance_layers, plan_layers
from mlxppd.core.profile.model import ModelProfile
from mlxppd.core.protocol.control import LayerLoad
from mlxppd.runtime.backends.contract import BackendUnavailable
from mlxppd.runtime.coordinator.chain import LayerMoveError
from mlxppd.runtime.coordinator.coordinator import Coordinator
from mlxppd.runtime.coordinator.gate import GatedBackend
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.wire.tasks import spawn, stop_tasks

log = logging.getLogger("mlxppd.elastic")

ELASTIC_HOLD = "elastic"
#: seconds one stage may take to load its new layers
PREPARE_TIMEOUT_S = 600.0
MAX_EVENTS = 256


class RepartitionFailed(MlxppError):
    """A step of the repartition could not be done; the previous ranges keep serving."""


class ElasticDriver:
    def __init__(
        self,
        policy: ElasticPolicy,
        ranges: tuple[LayerRange, ...],
        profile: ModelProfile,
        gate: GatedBackend,
        *,
        metrics: PipelineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.1,
        float32_profile: ModelProfile | None = None,
    ) -> None:
        self.machine = ElasticMachine(policy, ranges)
        self.profile = profile
        #: the model priced in float32, for plans over stages that hold float32 weights
        self.float32_profile = float32_profile
        self.gate = gate
        self.metrics = metrics
        self._clock = clock
        self._poll_s = poll_s
        self.events: deque[tuple[int, RepartitionEvent]] = deque(maxlen=MAX_EVENTS)
        self._next_event = 0
        self._task: asyncio.Task[None] | None = None
        #: per stage: tensors loaded / reused and load seconds of the last resume
        self.last_loads: list[LayerLoad | None] = []
        self._last_pressure_refusal: str | None = None

    # -- reading -------------------------------------------------------------------------------

    @property
    def state(self) -> ElasticState:
        return self.machine.state

    def last_event(self) -> dict[str, Any] | None:
        return self.events[-1][1].to_dict() if self.events else None

    def events_after(self, seq: int) -> list[dict[str, Any]]:
        return [{"seq": n, **e.to_dict()} for n, e in self.events if n > seq]

    def update_policy(self, policy: ElasticPolicy) -> None:
        self.machine = replace(self.machine, policy=policy)

    def reset_ranges(self, ranges: tuple[LayerRange, ...]) -> None:
        """The ranges in force changed outside the driver (an edited cluster.toml)."""
        self.machine = replace(self.machine, ranges=ranges)

    # -- triggers ------------------------------------------------------------------------------

    def trigger(
        self,
        trigger: Trigger,
        *,
        stage_memory: Sequence[int | None] | None = None,
        pp_layers: str | None = None,
    ) -> dict[str, Any]:
        """Start a repartition, or say why not. Returns at once; the work runs in a task."""
        coordinator = self.gate.coordinator
        if coordinator is not None and coordinator.serving.waits:
            return {"accepted": False, "reason": "failover", "message": "a failover is moving "
                    "the stages now; repartition once the cluster serves again"}  # fmt: skip
        if coordinator is not None and coordinator.plan is not None and not self._moving:
            # A failover may have changed the pipeline (survivors: fewer stages).
            self.machine = replace(self.machine, ranges=coordinator.plan)
        refused = self._refused_plan(stage_memory, pp_layers)
        if refused is not None:  # a bad plan is refused before anything drains
            return {"accepted": False, "reason": "invalid_plan", "message": refused}
        step = begin(self.machine, trigger, self._clock())
        if isinstance(step, Rejection):
            return {"accepted": False, "reason": str(step), "message": step.sentence()}
        self.machine, event = step
        self._record(event)
        self._task = spawn(self._run(stage_memory, pp_layers), name=f"elastic-{trigger}")
        return {"accepted": True, "state": str(self.machine.state), "seq": self._next_event - 1}

    @property
    def _moving(self) -> bool:
        return self.machine.state in (
            ElasticState.DRAINING, ElasticState.REBALANCING, ElasticState.RESUMING,
        )  # fmt: skip

    def _refused_plan(
        self, stage_memory: Sequence[int | None] | None, pp_layers: str | None
    ) -> str | None:
        """Why a given plan cannot be the pipeline's (None: it can, or none is given): a
        repartition keeps the number of stages serving now."""
        n = len(self.machine.ranges)
        if stage_memory is not None and len(stage_memory) != n:
            return (f"{len(stage_memory)} memory budgets given for the {n} stages serving now; "
                    f"give one per stage")  # fmt: skip
        if pp_layers is None:
            return None
        try:
            ranges = parse_pp_layers(pp_layers, self.profile.num_layers,
                                     self.profile.adjacency_groups)  # fmt: skip
        except MlxppError as exc:
            return str(exc)
        if len(ranges) != n:
            return (f"--pp-layers gives {len(ranges)} ranges for the {n} stages serving now; "
                    f"give one per stage")  # fmt: skip
        return None

    async def watch_pressure(self, stop: asyncio.Event, every_s: float = 1.0) -> None:
        """Fire ``memory_pressure`` when a stage's KV use crosses the policy's fraction."""
        while not stop.is_set():
            coordinator = self.gate.coordinator
            policy = self.machine.policy
            if policy.enabled and coordinator is not None and coordinator.connected:
                try:
                    await self._check_pressure(coordinator, policy)
                except BackendUnavailable:
                    pass  # the pipeline reconnects; look again next time
                except Exception:  # a bad report must not end the watch
                    log.exception("elastic: checking memory pressure failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every_s):
                    await stop.wait()

    async def _check_pressure(self, coordinator: Coordinator, policy: ElasticPolicy) -> None:
        reports = await coordinator.stage_reports()
        usage = [
            (r.stage, r.kv_used_bytes, configured_budget(r.kv_budget_bytes))
            for r in reports.values()
            if r is not None
        ]
        stage = pressured_stage(usage, policy.pressure_fraction)
        if stage is None:
            return
        outcome = self.trigger(Trigger.MEMORY_PRESSURE)
        if outcome["accepted"]:
            log.warning("elastic: stage %d is under KV pressure; repartitioning", stage)
        elif outcome["reason"] != self._last_pressure_refusal:
            log.info("elastic: stage %d is under KV pressure; %s", stage, outcome["message"])
        self._last_pressure_refusal = None if outcome["accepted"] else outcome["reason"]

    async def wait(self) -> None:
        await stop_tasks(self._task, cancel=False)

    async def close(self) -> None:
        await stop_tasks(self._task)

    # -- the flow ------------------------------------------------------------------------------

    async def _run(self, stage_memory: Sequence[int | None] | None, pp_layers: str | None) -> None:
        coordinator = self.gate.coordinator
        try:
            if coordinator is None or not coordinator.connected:
                raise RepartitionFailed("the pipeline is not connected")
            if coordinator.serving.waits:
                raise RepartitionFailed("a failover is moving the stages; nothing changed")
            self.gate.hold(
                ELASTIC_HOLD, "the cluster is moving layers between stages; retry shortly"
            )
            await coordinator.set_stage_admission(False, str(ElasticState.DRAINING))
            if not await self._drain(coordinator):
                self._fail(
                    f"requests were still in flight after {self.machine.policy.drain_timeout_s:g}"
                    " s (drain_timeout_s); nothing changed",
                    aborted=True,
                )
                return
            self._advance(drained(self.machine, self._clock()))
            target = await self._plan(coordinator, stage_memory, pp_layers)
            self._advance(planned(self.machine, target, self._clock()))
            await self._resume(coordinator, target)
            self._advance(resumed(self.machine, self._clock()))
        except (MlxppError, BackendUnavailable, OSError) as exc:
            self._fail(str(exc))
        except asyncio.CancelledError:
            if self._moving:
                self._fail("cancelled (shutdown)")
            raise
        finally:
            await self._release(coordinator)

    async def _drain(self, coordinator: Coordinator) -> bool:
        deadline = self._clock() + self.machine.policy.drain_timeout_s
        while True:
            reports = await coordinator.stage_reports()
            busy = any(r is None or r.active_sequences for r in reports.values())
            if not busy and self.gate.in_flight == 0:
                return True
            if any(r is None for r in reports.values()):
                raise RepartitionFailed("a stage stopped answering during the drain")
            if self._clock() >= deadline:
                return False
            await asyncio.sleep(self._poll_s)

    async def _plan(
        self,
        coordinator: Coordinator,
        stage_memory: Sequence[int | None] | None,
        pp_layers: str | None,
    ) -> tuple[LayerRange, ...]:
        n = len(self.machine.ranges)
        budgets: list[int | None]
        reports = await coordinator.stage_reports()
        by_stage = {r.stage: r for r in reports.values() if r is not None}
        # A stage holding float32 weights costs what the float32 pricing says; one such stage
        # prices the plan in float32 (never under-priced; native stages get slack).
        profile = self.profile
        if self.float32_profile is not None and any(
            r.weights == "float32" for r in by_stage.values()
        ):
            profile = self.float32_profile
        if stage_memory is not None:
            if len(stage_memory) != n:
                raise RepartitionFailed(f"{len(stage_memory)} memory budgets for {n} stages")
            budgets = list(stage_memory)
        else:
            # Each stage's budget as its node reports it (None: unlimited).
            budgets = [
                report.memory_budget_bytes if (report := by_stage.get(i)) is not None else None
                for i in range(n)
            ]
        if pp_layers is not None:
            ranges = parse_pp_layers(pp_layers, profile.num_layers, profile.adjacency_groups)
            plan = plan_layers(profile, ranges, budgets)
            over = [s for s in plan.stages if s.shortfall_bytes]
            if over:
                s0 = over[0]
                raise RepartitionFailed(
                    f"--pp-layers puts {s0.estimated_memory_bytes} bytes on stage "
                    f"{s0.stage_index}, over its budget of {s0.budget_bytes}"
                )
            return tuple(ranges)
        return tuple(balance_layers(profile, n, budgets).ranges)

    async def _resume(self, coordinator: Coordinator, target: tuple[LayerRange, ...]) -> None:
        try:
            replies = await coordinator.move_stages(target, PREPARE_TIMEOUT_S)
        except LayerMoveError as exc:
            if exc.committed:
                raise RepartitionFailed(str(exc)) from None
            index, error = exc.refusals[0]
            raise RepartitionFailed(
                f"stage {index} could not load its new layers: {error}"
            ) from None
        self.last_loads = [r.load() for r in replies]

    async def _release(self, coordinator: Coordinator | None) -> None:
        if coordinator is not None and coordinator.connected:
            with contextlib.suppress(BackendUnavailable):
                await coordinator.set_stage_admission(True, str(self.machine.state))
        self.gate.release(ELASTIC_HOLD)

    # -- events --------------------------------------------------------------------------------

    def _advance(self, step: tuple[ElasticMachine, RepartitionEvent]) -> None:
        self.machine, event = step
        self._record(event)

    def _fail(self, reason: str, *, aborted: bool = False) -> None:
        self._advance(fail(self.machine, reason, self._clock(), aborted=aborted))

    def _record(self, event: RepartitionEvent) -> None:
        self.events.append((self._next_event, event))
        self._next_event += 1
        line = "elastic: %s"
        if event.outcome in ("failed", "aborted"):
            log.error(line, event.describe())
        else:
            log.info(line, event.describe())
        if self.metrics is None:
            return
        m = self.metrics
        m.repartition_events.labels(trigger=str(event.trigger), outcome=str(event.outcome)).inc()
        if event.from_state is ElasticState.DRAINING:
            m.repartition_drain.observe(event.phase_s)
            current = m.repartition_drain_max._value.get()
            m.repartition_drain_max.set(max(current, event.phase_s))
        if event.to_state in (ElasticState.IDLE, ElasticState.FAILED):
            m.repartition_total.observe(event.total_s)
