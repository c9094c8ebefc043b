"""A stage worker's control plane: what it does for the coordinator's commands.

Configure (where output goes, heartbeats), KV admission with the sampler made at admission,
the two phases of a layer move (a repartition, a standby adopting a lost stage, survivors
closing a gap), and the status report. A mixin of ``StageWorker`` (``stage_worker.py``), which
holds the state and runs the data plane; kept apart so each file holds one concern.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxppd.core.kv_admission import (
    AdmissionDiagnostic,
    AdmissionRequest,
    RejectReason,
    SlotKvManager,
    StageKvManager,
)
from mlxppd.core.log_text import escape
from mlxppd.core.protocol.adapters import AdapterLoad, AdapterReply, AdapterUnload
from mlxppd.core.protocol.control import (
    Ack,
    Admit,
    AdmitRefusal,
    AdmitReply,
    Configure,
    Heartbeat,
    LatencyReport,
    LayerLoad,
    Reassign,
    ReassignReply,
    SlotReport,
    StageReport,
    WireCounters,
    clip,
)
from mlxppd.core.protocol.sampling import parse_sampler_spec
from mlxppd.core.stage_accounting import ActivityClock, LatencyHistogram
from mlxppd.core.stages import StageSpec
from mlxppd.core.strict import StrictModel
from mlxppd.engine.blas import blas_in_use
from mlxppd.engine.sampling import SequenceSampler, constraint_for, make_sampler
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.engine.tp_mirror import MirroredRunner
from mlxppd.runtime.observability.trace import TraceBuffer
from mlxppd.runtime.stage.work import PrepareLayers, ReleaseAllWork, StageStats
from mlxppd.runtime.stage.work_queue import WorkQueue
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import ChannelClosedError
from mlxppd.wire.tasks import TaskSet
from mlxppd.wire.transport import Transport

log = logging.getLogger("mlxppd.stage")


class ProtocolViolation(Exception):
    """A message that authenticated fine but makes no sense here."""


async def send_reply(channel: SecureChannel, answer: StrictModel, payload: Any = None) -> None:
    """A REPLY whose metadata is exactly ``answer``'s fields."""
    await channel.send(MessageKind.REPLY, answer.model_dump(mode="json"), payload)


class StageControl:
    """The coordinator's commands on a stage (mixed into ``StageWorker``)."""

    spec: StageSpec
    runner: StageRunner | None
    kv: StageKvManager
    transport: Transport
    stats: StageStats
    clock: ActivityClock
    latency: LatencyHistogram
    trace: TraceBuffer
    admitting: bool
    elastic_state: str
    _coordinator: SecureChannel | None
    _downstream: SecureChannel | None
    _work: WorkQueue
    _side_tasks: TaskSet
    _heartbeat_interval_s: float | None
    _heartbeat_timeout_s: float | None
    _prepare_layers: PrepareLayers | None
    _staged: tuple[StageSpec, StageRunner, StageKvManager] | None
    _extras: Any
    _load_tokenizer: Any
    _tokenizer: Any
    slot_nodes: tuple[tuple[str, int], ...]

    def _release_accounting(self) -> None:
        self.kv.clear()  # the prompt-cache entries were the coordinator's too
        self.clock.set_active(0, time.monotonic())

    def _layers(self) -> StageRunner:
        if self.runner is None:
            raise ProtocolViolation("this node is a standby: it serves no layers yet")
        return self.runner

    if TYPE_CHECKING:  # provided by StageWorker, which queues it on the compute loop
        mlx: MlxThread

        async def swap(self, spec: StageSpec, runner: StageRunner, kv: StageKvManager) -> None: ...

    async def _configure(self, channel: SecureChannel, command: Configure) -> Ack:
        first = self._coordinator is not channel
        if first and self._coordinator is not None:
            # Another coordinator (or this one, reconnected after a failover) takes over:
            # nobody will release what the previous one admitted here.
            self._release_accounting()
            await self._work.put(ReleaseAllWork())
        self._coordinator = channel
        self.trace.enabled = command.trace
        self._heartbeat_timeout_s = command.heartbeat_timeout_s
        self._heartbeat_interval_s = command.heartbeat_interval_s
        if first and command.heartbeat_interval_s is not None:
            self._side_tasks.spawn(
                self._heartbeats(channel, command.heartbeat_interval_s), name="stage-heartbeat"
            )
        if command.next_host is None or command.next_port is None:
            self._downstream = channel
            return Ack(rid=command.rid)
        try:
            if self._downstream is not None:
                await self._downstream.close()
            self._downstream = await self.transport.connect(
                command.next_host, command.next_port, expected_peer=command.next_node
            )
        except Exception as exc:  # reported to the coordinator, which gives up cleanly
            return Ack(rid=command.rid, ok=False, error=clip(str(exc)))
        return Ack(rid=command.rid)

    def _admit(self, command: Admit, payload: Any = None) -> AdmitReply:
        """``payload``: the last stage's ``SamplerSpec`` (JSON), when the request has one."""
        request = AdmissionRequest(command.seq, command.prompt_tokens, command.max_tokens)
        problem = (
            self._closed_reason(command)
            or self.kv.dry_run(request)
            or self._adapter_refused(command)
            or self._sampling_refused(command, payload)
        )
        if problem is None and command.commit:
            if command.adapter is not None:
                self._layers().set_adapter(command.seq, command.adapter)
            self.kv.commit(request)
            self.clock.set_active(len(self.kv.reserved), time.monotonic())
        if problem is None:
            return AdmitReply(rid=command.rid, ok=True)
        return AdmitReply(rid=command.rid, ok=False, diagnostic=AdmitRefusal.of(problem))

    async def _adapter_command(
        self, channel: SecureChannel, command: AdapterLoad | AdapterUnload
    ) -> None:
        """Load or drop a per-request adapter on the mlx thread, between forward passes."""
        reply = AdapterReply(rid=command.rid)
        try:
            adapters = self._layers().stage.adapters
            if adapters is None or isinstance(self.runner, MirroredRunner):
                raise ValueError("adapters run on stages of one rank")
            if self._staged is not None or not self.admitting:
                # New layers being loaded copy the adapters held when they started.
                raise ValueError("this stage is moving its layers; try again once it serves")
            if isinstance(command, AdapterLoad):
                load = functools.partial(adapters.load, command.name, Path(command.path))
                info = await self.mlx.run(load)
                reply = AdapterReply(
                    rid=command.rid, digest=info.digest, read=info.read, stored=info.stored,
                    modules=info.modules,
                )  # fmt: skip
                log.info(
                    "stage %d: adapter %s loaded from %s: %d modules, %d of its %d tensors read",
                    self.spec.index, escape(command.name), escape(command.path), info.modules,
                    info.read, info.stored,
                )  # fmt: skip
            else:
                await self.mlx.run(functools.partial(adapters.unload, command.name))
                log.info("stage %d: adapter %s unloaded", self.spec.index, escape(command.name))
        except Exception as exc:  # reported to the coordinator, which undoes it everywhere
            reply = AdapterReply(rid=command.rid, ok=False, error=clip(str(exc) or repr(exc)))
        await send_reply(channel, reply)

    def _adapter_refused(self, command: Admit) -> AdmissionDiagnostic | None:
        """A request for an adapter this stage does not hold is refused, alone."""
        if command.adapter is None:
            return None
        adapters = self._layers().stage.adapters
        if adapters is None or command.adapter not in adapters.named:
            log.warning(
                "stage %d: refusing %s: adapter %s is not loaded here",
                self.spec.index, escape(command.seq), escape(command.adapter),
            )  # fmt: skip
            return self.kv.refusal(RejectReason.INVALID_REQUEST)
        return None

    def _grammar_tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self._load_tokenizer is None:
                raise ValueError("this stage has no tokenizer to constrain output with")
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _closed_reason(self, command: Admit) -> AdmissionDiagnostic | None:
        if self.spec.is_standby:
            return self.kv.refusal(RejectReason.PLAN_MISMATCH)
        if not self.admitting:
            return self.kv.refusal(RejectReason.DRAINING)
        if command.plan is not None and not self.spec.matches(command.plan):
            return self.kv.refusal(RejectReason.PLAN_MISMATCH)
        return None

    def _sampling_refused(self, command: Admit, payload: Any) -> AdmissionDiagnostic | None:
        """The last stage makes the sequence's sampler here (dry run included), so parameters
        it cannot serve refuse this one request instead of failing later on the mlx thread."""
        if not self.spec.has_lm_head:
            return None
        try:
            spec = parse_sampler_spec(bytes(payload.data)) if payload is not None else None
            draw = make_sampler(
                command.temperature, command.top_p, command.seed, command.first_draw,
                top_k=spec.top_k if spec else 0, min_p=spec.min_p if spec else 0.0,
            )  # fmt: skip
            vocab = None
            if spec is not None and (spec.logit_bias or spec.grammar):
                size = self._layers().stage.config.get("vocab_size")
                vocab = size if isinstance(size, int) else None
            constraint = None
            # The grammar compiles once, at the commit (a schema it refuses refuses there).
            if spec is not None and spec.grammar is not None and command.commit:
                constraint = constraint_for(spec.grammar, self._grammar_tokenizer(), vocab or 0)
            sampler = SequenceSampler(draw, spec, vocab, constraint)
        except Exception as exc:
            log.warning("stage %d: refusing %s: %s", self.spec.index, escape(command.seq), exc)
            return self.kv.refusal(RejectReason.INVALID_REQUEST)
        if command.commit:
            self._layers().set_sampler(command.seq, sampler)
        return None

    async def _reassign(self, channel: SecureChannel, command: Reassign) -> None:
        reply = ReassignReply(rid=command.rid)
        try:
            if command.phase == "prepare":
                load = await self._prepare(command.plan, command.stage)
                reply = ReassignReply(rid=command.rid, **load.model_dump())
            elif command.phase == "commit":
                if self._staged is None:
                    raise ProtocolViolation("commit without a prepared plan")
                spec, runner, kv = self._staged
                self._staged = None
                # The KV budget belongs to the node, not to its layers: the one in force now
                # (a reload may have changed it since this stage started) carries over.
                kv.budget_bytes = self.kv.budget_bytes
                await self.swap(spec, runner, kv)
                self.elastic_state = "idle"
            else:
                self._staged = None
                self.elastic_state = "idle"
        except Exception as exc:  # reported to the coordinator, which aborts everywhere
            self._staged = None
            error = clip(str(exc) or type(exc).__name__)
            reply = ReassignReply(rid=command.rid, ok=False, error=error)
        with contextlib.suppress(ChannelClosedError):
            await send_reply(channel, reply)

    async def _prepare(self, plan: list[tuple[int, int]], stage: int | None) -> LayerLoad:
        """Load the layers of stage ``stage`` of ``plan`` (None: this one's index) beside the
        current ones: a repartition, a standby adopting a lost stage, survivors closing a gap."""
        if self._prepare_layers is None:
            raise ProtocolViolation("this stage cannot change its layers")
        index = self.spec.index if stage is None else stage
        if not 0 <= index < len(plan):
            raise ProtocolViolation(f"no stage {index} in a plan of {len(plan)} stages")
        if self.kv.reserved:
            raise ProtocolViolation(f"{len(self.kv.reserved)} sequences still hold KV here")
        start, end = plan[index]
        spec = StageSpec(index, len(plan), start, end)
        self.elastic_state = "resuming"
        runner, kv, load = await self._prepare_layers(spec, self.runner)
        self._staged = (spec, runner, kv)
        return load

    def status(self, rid: int = 0) -> StageReport:
        """This stage's report (the reply to a status command), with the agent's extras."""
        elapsed = max(time.monotonic() - self.stats.started, 1e-9)
        clock = self.clock.snapshot(time.monotonic())
        h = self.latency
        return StageReport(
            **self._extras().model_dump(),
            rid=rid,
            stage=self.spec.index,
            layers=(self.spec.start, self.spec.end),
            parameter_bytes=self.runner.stage.parameter_bytes if self.runner else 0,
            weights=str(self.runner.stage.weights) if self.runner else "none",
            blas=clip(str(blas_in_use())),
            kv_used_bytes=self.kv.used_bytes,
            kv_budget_bytes=self.kv.budget_bytes,
            active_sequences=len(self.kv.reserved),
            forwards=self.stats.forwards,
            busy_fraction=min(1.0, self.stats.busy_s / elapsed),
            protocol_errors=self.stats.protocol_errors,
            batched_passes=self.stats.batched_passes,
            batched_rows=self.stats.batched_rows,
            busy_s=clock["busy_s"],
            active_s=clock["active_s"],
            wall_s=clock["wall_s"],
            activation_latency=LatencyReport(
                counts=list(h.counts), sum=h.total, count=h.count, max=h.max
            ),
            wire=WireCounters.model_validate(self.transport.stats.snapshot()),
            trace_dropped=self.trace.dropped,
            admission="open" if self.admitting else "draining",
            elastic_state=self.elastic_state,
            now=time.time(),
            slots=self._slots(),
        )

    def _slots(self) -> list[SlotReport]:
        kv = self.kv
        if not isinstance(kv, SlotKvManager) or not self.slot_nodes:
            return []
        return [
            SlotReport(
                rank=rank,
                node_id=node,
                parameter_bytes=nbytes,
                kv_used_bytes=slot.used_bytes,
                kv_budget_bytes=slot.budget_bytes,
            )  # fmt: skip
            for rank, ((node, nbytes), slot) in enumerate(
                zip(self.slot_nodes, sorted(kv.slots, key=lambda k: k.rank or 0), strict=True)
            )
        ]

    async def _heartbeats(self, channel: SecureChannel, interval_s: float) -> None:
        """Say "alive" to the coordinator every interval while it is the coordinator."""
        while self._coordinator is channel and not channel.closed:
            try:
                await channel.send(MessageKind.CONTROL, Heartbeat().model_dump())
            except ChannelClosedError:
                return
            await asyncio.sleep(interval_s)
