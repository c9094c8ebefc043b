"""A stage worker: serves one layer range on its transport address.

Input (token ids on stage 0, activations elsewhere) arrives on any accepted channel and is run
in arrival order on the mlx thread; each result is queued for a sender task, so the next
forward computes while the previous activation is on the wire. The coordinator's channel
carries control commands; on the last stage it also carries the sampled tokens back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from mlxppd.core.kv_admission import (
    AdmissionDiagnostic,
    AdmissionRequest,
    RejectReason,
    StageKvManager,
)
from mlxppd.core.log_text import escape
from mlxppd.core.protocol.control import (
    Ack,
    Admission,
    Admit,
    AdmitRefusal,
    AdmitReply,
    Configure,
    LatencyReport,
    LayerLoad,
    Reassign,
    ReassignReply,
    Release,
    StageExtras,
    StageReport,
    Status,
    TraceDump,
    TraceReply,
    WireCounters,
    clip,
    parse_control,
)
from mlxppd.core.protocol.pipeline import (
    BatchForwardMeta,
    BatchTokenMeta,
    ForwardMeta,
    GroupFailure,
    SequenceFailure,
    TokenMeta,
)
from mlxppd.core.stage_accounting import ActivityClock, LatencyHistogram
from mlxppd.core.stages import StageSpec
from mlxppd.core.strict import StrictModel
from mlxppd.engine.blas import blas_in_use
from mlxppd.engine.sampling import make_sampler
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.engine.wire_tensors import from_wire, to_wire
from mlxppd.runtime.observability.trace import TraceBuffer, now_us
from mlxppd.runtime.pipeline.stage_work import (
    ForwardWork,
    GroupWork,
    Output,
    ReleaseAllWork,
    ReleaseWork,
    SwapWork,
    Work,
)
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Message, MessageKind
from mlxppd.wire.errors import ChannelClosedError, FrameError
from mlxppd.wire.tasks import TaskSet, spawn, stop_tasks
from mlxppd.wire.transport import Listener, Transport

log = logging.getLogger("mlxppd.stage")

#: loads a stage's new layers, reusing what the current runner holds: (runner, kv, what it read)
PrepareLayers = Callable[
    [StageSpec, StageRunner], Awaitable[tuple[StageRunner, StageKvManager, LayerLoad]]
]
#: what the agent adds to each status report (config generation, reload error, ...)
ExtrasSource = Callable[[], StageExtras]


class ProtocolViolation(Exception):
    """A message that authenticated fine but makes no sense here."""


@dataclass
class StageStats:
    forwards: int = 0
    busy_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    protocol_errors: int = 0
    batched_passes: int = 0
    batched_rows: int = 0
    #: sequences whose forward or sampler failed here (each failed its request alone)
    sequence_failures: int = 0


class StageWorker:
    def __init__(
        self,
        spec: StageSpec,
        runner: StageRunner,
        kv: StageKvManager,
        transport: Transport,
        mlx: MlxThread,
        *,
        extras: ExtrasSource | None = None,
        prepare_layers: PrepareLayers | None = None,
    ) -> None:
        self.spec = spec
        self.runner = runner
        self.kv = kv
        self.transport = transport
        self.mlx = mlx
        self.stats = StageStats()
        self.clock = ActivityClock(started=time.monotonic())
        self.latency = LatencyHistogram()
        self.trace = TraceBuffer(pid=f"stage-{spec.index}", enabled=False)
        self._work: asyncio.Queue[Work] = asyncio.Queue()
        self._out: asyncio.Queue[Output] = asyncio.Queue()
        self._downstream: SecureChannel | None = None
        self._coordinator: SecureChannel | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._listener: Listener | None = None
        # Closed while draining (reload, shutdown): admits are refused, running sequences finish.
        self.admitting = True
        # What the agent adds to each status report (config generation, reload error, ...).
        self._extras = extras or StageExtras
        self._prepare_layers = prepare_layers
        self._staged: tuple[StageSpec, StageRunner, StageKvManager] | None = None
        self._side_tasks = TaskSet()
        self.elastic_state = "idle"
        # Sequences that failed here: their queued inputs are skipped until released.
        self._failed: set[str] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._loops = [
            spawn(self._compute_loop(), name=f"stage{self.spec.index}-compute", forever=True),
            spawn(self._send_loop(), name=f"stage{self.spec.index}-send", forever=True),
        ]
        self._listener = await self.transport.listen(host, port, self._serve)
        return self._listener.address

    @property
    def address(self) -> tuple[str, int] | None:
        return self._listener.address if self._listener is not None else None

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Stop admitting; True once no sequence holds KV here, False at the timeout."""
        self.admitting = False
        deadline = time.monotonic() + timeout_s
        while self.kv.reserved:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def resume(self) -> None:
        self.admitting = True

    async def swap(self, spec: StageSpec, runner: StageRunner, kv: StageKvManager) -> None:
        """Serve new layers from now on. Queued after any earlier work, so nothing in flight
        runs half on the old layers and half on the new."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._work.put(SwapWork(spec, runner, kv, done))
        await done

    async def rebind(self, transport: Transport, host: str, port: int) -> tuple[str, int]:
        """Listen again (another address or transport); peers reconnect to the new one."""
        if self._listener is not None:
            await self._listener.close()
        if self._downstream is not None and self._downstream is not self._coordinator:
            await self._downstream.close()
        self._downstream = None
        self.transport = transport
        self._listener = await transport.listen(host, port, self._serve)
        return self._listener.address

    async def close(self) -> None:
        s = self.stats
        mean_rows = s.batched_rows / s.batched_passes if s.batched_passes else 0.0
        log.info(
            "stage %d: %d forward passes, %d of them micro-batches of %.2f sequences on average",
            self.spec.index, s.forwards, s.batched_passes, mean_rows,
        )  # fmt: skip
        if self._listener is not None:
            await self._listener.close()
        await stop_tasks(*self._loops, *self._side_tasks)
        if self._downstream is not None:
            await self._downstream.close()

    # -- connections ---------------------------------------------------------------------------

    async def _serve(self, channel: SecureChannel) -> None:
        try:
            async for message in channel:
                await self._dispatch(channel, message)
        except (ChannelClosedError, FrameError) as exc:
            log.info("stage %d: channel %s closed: %s", self.spec.index, channel.peer_address, exc)
        except (ValidationError, ProtocolViolation) as exc:
            self.stats.protocol_errors += 1
            detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            log.warning(
                "stage %d: malformed message from %s, closing: %s",
                self.spec.index,
                channel.peer_address,
                detail,
            )
        finally:
            await channel.close()
            if channel is self._coordinator:
                # The coordinator is gone: nobody will release its sequences.
                self._coordinator = None
                await self._work.put(ReleaseAllWork())

    async def _dispatch(self, channel: SecureChannel, message: Message) -> None:
        if message.kind is MessageKind.ACTIVATION:
            if "group" in message.meta:
                batch = BatchForwardMeta.model_validate(dict(message.meta))
                self._arrived(batch.sent_at, message)
                await self._work.put(GroupWork(batch, message.tensor))
            else:
                meta = ForwardMeta.model_validate(dict(message.meta))
                self._arrived(meta.sent_at, message)
                await self._work.put(ForwardWork(meta, message.tensor))
            return
        if message.kind is not MessageKind.CONTROL:
            raise ProtocolViolation(f"a stage does not accept {message.kind.name} messages")
        # One parse: an unknown op or field is a ValidationError, counted by ``_serve``.
        command = parse_control(message.meta)
        if isinstance(command, Configure):
            await _reply(channel, await self._configure(channel, command))
        elif isinstance(command, Admit):
            await _reply(channel, self._admit(command))
        elif isinstance(command, Release):
            await self._work.put(ReleaseWork(command.seq))
        elif isinstance(command, Status):
            await _reply(channel, self.status(command.rid))
        elif isinstance(command, Admission):
            self.admitting = command.open
            self.elastic_state = command.state
            await _reply(channel, Ack(rid=command.rid))
        elif isinstance(command, Reassign):
            # Loading takes long; this channel keeps answering status meanwhile.
            self._side_tasks.spawn(self._reassign(channel, command), name="stage-reassign")
        elif isinstance(command, TraceDump):
            # Events can be many: they travel as a JSON byte tensor, not as metadata.
            payload = np.frombuffer(json.dumps(self.trace.take()).encode(), dtype=np.uint8)
            await _reply(channel, TraceReply(rid=command.rid), payload)

    def _arrived(self, sent_at: float | None, message: Message) -> None:
        nbytes = message.tensor.nbytes if message.tensor is not None else 0
        if sent_at is not None:
            self.latency.observe(time.time() - sent_at)
        self.trace.instant("activation_recv", self.spec.index, bytes=nbytes, direction="recv")

    async def _configure(self, channel: SecureChannel, command: Configure) -> Ack:
        self._coordinator = channel
        self.trace.enabled = command.trace
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

    def _admit(self, command: Admit) -> AdmitReply:
        request = AdmissionRequest(command.seq, command.prompt_tokens, command.max_tokens)
        problem = (
            self._closed_reason(command)
            or self.kv.dry_run(request)
            or self._sampling_refused(command)
        )
        if problem is None and command.commit:
            self.kv.commit(request)
            self.clock.set_active(len(self.kv.reserved), time.monotonic())
        if problem is None:
            return AdmitReply(rid=command.rid, ok=True)
        return AdmitReply(rid=command.rid, ok=False, diagnostic=AdmitRefusal.of(problem))

    async def _reassign(self, channel: SecureChannel, command: Reassign) -> None:
        reply = ReassignReply(rid=command.rid)
        try:
            if command.phase == "prepare":
                load = await self._prepare(command.plan)
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
            await _reply(channel, reply)

    async def _prepare(self, plan: list[tuple[int, int]]) -> LayerLoad:
        if self._prepare_layers is None:
            raise ProtocolViolation("this stage cannot change its layers")
        if len(plan) != self.spec.num_stages:
            raise ProtocolViolation(f"a plan of {len(plan)} stages for {self.spec.num_stages}")
        if self.kv.reserved:
            raise ProtocolViolation(f"{len(self.kv.reserved)} sequences still hold KV here")
        start, end = plan[self.spec.index]
        spec = StageSpec(self.spec.index, self.spec.num_stages, start, end)
        self.elastic_state = "resuming"
        runner, kv, load = await self._prepare_layers(spec, self.runner)
        self._staged = (spec, runner, kv)
        return load

    def _closed_reason(self, command: Admit) -> AdmissionDiagnostic | None:
        if not self.admitting:
            return self.kv.refusal(RejectReason.DRAINING)
        if command.plan is not None and not self.spec.matches(command.plan):
            return self.kv.refusal(RejectReason.PLAN_MISMATCH)
        return None

    def _sampling_refused(self, command: Admit) -> AdmissionDiagnostic | None:
        """The last stage makes the sequence's sampler here (dry run included), so parameters
        it cannot serve refuse this one request instead of failing later on the mlx thread."""
        if not self.spec.has_lm_head:
            return None
        try:
            sampler = make_sampler(command.temperature, command.top_p, command.seed)
        except Exception as exc:
            log.warning("stage %d: refusing %s: %s", self.spec.index, escape(command.seq), exc)
            return self.kv.refusal(RejectReason.INVALID_REQUEST)
        if command.commit:
            self.runner.set_sampler(command.seq, sampler)
        return None

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
            parameter_bytes=self.runner.stage.parameter_bytes,
            weights=str(self.runner.stage.weights),
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
        )

    # -- compute and send ----------------------------------------------------------------------

    async def _compute_loop(self) -> None:
        while True:
            item = await self._work.get()
            if isinstance(item, ForwardWork):
                await self._forward(item.meta, item.tensor)
            elif isinstance(item, GroupWork):
                await self._forward_group(item.meta, item.tensor)
            elif isinstance(item, ReleaseWork):
                self._failed.discard(item.seq)
                self.kv.release(item.seq)
                self.clock.set_active(len(self.kv.reserved), time.monotonic())
                await self.mlx.run(functools.partial(self.runner.release, item.seq))
            elif isinstance(item, ReleaseAllWork):
                self._failed.clear()
                for held in list(self.kv.reserved):
                    self.kv.release(held)
                self.clock.set_active(0, time.monotonic())
                await self.mlx.run(self.runner.release_all)
            elif isinstance(item, SwapWork):
                self.spec, self.runner, self.kv = item.spec, item.runner, item.kv
                self.clock.set_active(len(item.kv.reserved), time.monotonic())
                item.done.set_result(None)

    def _computed(self, started: float, start_us: float, rows: int) -> None:
        elapsed = time.monotonic() - started
        self.stats.busy_s += elapsed
        self.stats.forwards += 1
        self.clock.busy(elapsed)
        self.trace.span("stage", self.spec.index, start_us, now_us(), rows=rows)

    async def _forward(self, meta: ForwardMeta, tensor: Any) -> None:
        if meta.seq in self._failed:
            return  # the rest of a failed sequence's prefill: its request has been told
        started = time.monotonic()
        sample = meta.sample and self.spec.has_lm_head

        def run() -> Any:
            x = from_wire(tensor)
            if sample:
                return self.runner.forward_and_sample(meta.seq, x, meta.logprobs)
            return to_wire(self.runner.forward(meta.seq, x))

        start_us = now_us()
        try:
            result = await self.mlx.run(run)
        except Exception as exc:
            # This input cannot run here (a bad tensor, a family's forward or the sampler
            # raising): only its sequence fails; the link and every other sequence carry on.
            await self._sequence_failed(meta.seq, exc)
            return
        self._computed(started, start_us, rows=1)
        if self.spec.has_lm_head:
            if sample:
                token = np.array([result.token], dtype=np.int32)
                out = TokenMeta(seq=meta.seq, step=meta.step, logprob=result.logprob)
                await self._out.put((MessageKind.TOKENS, out, token))
            return
        await self._out.put((MessageKind.ACTIVATION, meta, result))

    async def _sequence_failed(self, seq: str, exc: Exception) -> None:
        self.stats.sequence_failures += 1
        log.error("stage %d: sequence %s failed: %s", self.spec.index, escape(seq), exc)
        self._failed.add(seq)
        await self.mlx.run(functools.partial(self.runner.release, seq))
        failure = SequenceFailure(seq=seq, stage=self.spec.index, message=clip(str(exc), 1000))
        await self._out.put((MessageKind.ERROR, failure, None))

    async def _forward_group(self, meta: BatchForwardMeta, tensor: Any) -> None:
        started = time.monotonic()
        last = self.spec.has_lm_head

        def run() -> Any:
            x = from_wire(tensor)
            if x.shape[0] != len(meta.seqs):
                raise ValueError(f"{x.shape[0]} rows for {len(meta.seqs)} sequences")
            if last:
                return self.runner.forward_group_and_sample(meta.group, meta.seqs, x, meta.logprobs)
            return to_wire(self.runner.forward_group(meta.group, meta.seqs, x))

        start_us = now_us()
        try:
            result = await self.mlx.run(run)
        except Exception as exc:
            # This group cannot run here (a malformed batch, a cache kind that cannot batch):
            # drop its state and tell the coordinator, which fails its requests cleanly.
            log.error("stage %d: micro-batch %s failed: %s", self.spec.index, meta.group, exc)
            for seq in meta.seqs:
                await self.mlx.run(functools.partial(self.runner.release, seq))
            error = GroupFailure(group=meta.group, seqs=meta.seqs, message=clip(str(exc), 1000))
            await self._out.put((MessageKind.ERROR, error, None))
            return
        self._computed(started, start_us, rows=len(meta.seqs))
        self.stats.batched_passes += 1
        self.stats.batched_rows += len(meta.seqs)
        if last:
            tokens = np.array([s.token for s in result], dtype=np.int32)
            out = BatchTokenMeta(
                group=meta.group,
                seqs=meta.seqs,
                step=meta.step,
                logprobs=[s.logprob for s in result] if meta.logprobs else None,
            )
            await self._out.put((MessageKind.TOKENS, out, tokens))
            return
        await self._out.put((MessageKind.ACTIVATION, meta, result))

    async def _send_loop(self) -> None:
        while True:
            kind, meta, tensor = await self._out.get()
            to_coordinator = kind in (MessageKind.TOKENS, MessageKind.ERROR)
            target = self._coordinator if to_coordinator else self._downstream
            if target is None:
                log.warning("stage %d: no %s channel; dropping output", self.spec.index, kind.name)
                continue
            if kind is MessageKind.ACTIVATION:
                meta = meta.model_copy(update={"sent_at": time.time()})
                nbytes = tensor.nbytes if tensor is not None else 0
                self.trace.instant(
                    "activation_send", self.spec.index, bytes=nbytes, direction="send"
                )
            try:
                await target.send(kind, meta.model_dump(), tensor)
            except ChannelClosedError as exc:
                log.error("stage %d: sending %s failed: %s", self.spec.index, kind.name, exc)


async def _reply(channel: SecureChannel, reply: StrictModel, payload: Any = None) -> None:
    """A REPLY whose metadata is exactly ``reply``'s fields."""
    await channel.send(MessageKind.REPLY, reply.model_dump(mode="json"), payload)
