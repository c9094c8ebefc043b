"""A stage worker: serves one layer range on its transport address.

Input (token ids on stage 0, activations elsewhere) arrives on any accepted channel and is run
in arrival order on the mlx thread; each result is queued for a sender task, so the next
forward computes while the previous activation is on the wire. The coordinator's channel
carries control commands; on the last stage it also carries the sampled tokens back.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import ValidationError

from mlxppd.core.kv_admission import (
    StageKvManager,
)
from mlxppd.core.log_text import escape
from mlxppd.core.protocol.adapters import AdapterLoad, AdapterUnload
from mlxppd.core.protocol.control import (
    Ack,
    Admission,
    Admit,
    Configure,
    Forget,
    Heartbeat,
    Reassign,
    Release,
    StageExtras,
    Status,
    TraceDump,
    TraceReply,
    clip,
    parse_control,
)
from mlxppd.core.protocol.model_transfer import (
    Identify,
    PrepareCheck,
    PrepareCommit,
    PrepareData,
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
from mlxppd.engine.prepared_copy import ModelReceiver
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.engine.stage_threads import StageThreads
from mlxppd.engine.tp_mirror import MirroredRunner
from mlxppd.engine.wire_tensors import from_wire, to_wire
from mlxppd.runtime.observability.trace import TraceBuffer, now_us
from mlxppd.runtime.stage.control import ProtocolViolation, StageControl, send_reply
from mlxppd.runtime.stage.model_commands import StageModel
from mlxppd.runtime.stage.tp_links import FollowerLinks
from mlxppd.runtime.stage.work import (
    ExtrasSource,
    ForgetWork,
    ForwardWork,
    GroupWork,
    Output,
    PrepareLayers,
    ReleaseAllWork,
    ReleaseWork,
    StageStats,
    SwapWork,
)
from mlxppd.runtime.stage.work_queue import WorkQueue
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Message, MessageKind
from mlxppd.wire.errors import ChannelClosedError, FrameError
from mlxppd.wire.tasks import TaskSet, spawn, stop_tasks
from mlxppd.wire.transport import Listener, Transport

log = logging.getLogger("mlxppd.stage")


class StageWorker(StageControl, StageModel):
    def __init__(
        self,
        spec: StageSpec,
        runner: StageRunner | None,
        kv: StageKvManager,
        transport: Transport,
        mlx: MlxThread,
        *,
        extras: ExtrasSource | None = None,
        prepare_layers: PrepareLayers | None = None,
        receiver: ModelReceiver | None = None,
        missing_model: str | None = None,
        tokenizer: Callable[[], Any] | None = None,
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
        # Arrival order, but a decode step runs before the next prefill chunk (work_queue.py).
        self._work = WorkQueue()
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
        # Where mlxppctl prepare's tensors go (None: this node takes none), and why this node
        # serves nothing yet when its model files are missing.
        self.receiver = receiver
        self.missing_model = missing_model
        # The last stage compiles output grammars against the tokenizer: loaded on first use.
        self._load_tokenizer = tokenizer
        self._tokenizer: Any = None
        self._staged: tuple[StageSpec, StageRunner, StageKvManager] | None = None
        self._side_tasks = TaskSet()
        self._threads = StageThreads()
        self.elastic_state = "idle"
        # Sequences that failed here: their queued inputs are skipped until released.
        self._failed: set[str] = set()
        # Set by the coordinator's Configure: how often to say "alive", how long its silence
        # may last before it counts as lost (None: no heartbeats).
        self._heartbeat_interval_s: float | None = None
        self._heartbeat_timeout_s: float | None = None
        # A tensor-parallel stage's slots: every rank's node id and shard bytes, rank order.
        self.slot_nodes: tuple[tuple[str, int], ...] = ()
        #: set when a tensor-parallel rank of this stage is gone: the stage cannot compute
        #: again until its ranks start again together (the node's owner restarts it)
        self.ring_lost = asyncio.Event()
        #: rank 0 of a tensor-parallel stage: its links to the other ranks
        self.followers: FollowerLinks | None = None

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
        if self.followers is not None:
            await self.followers.close()  # each other rank sees its link close and stops

    # -- connections ---------------------------------------------------------------------------

    async def _serve(self, channel: SecureChannel) -> None:
        try:
            while (message := await self._receive(channel)) is not None:
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
                # The coordinator is gone: nobody will release its sequences. The accounting
                # frees at once (a new coordinator's admissions and layer moves see it empty);
                # the caches go in order on the compute loop.
                self._coordinator = None
                self._release_accounting()
                await self._work.put(ReleaseAllWork())

    async def _receive(self, channel: SecureChannel) -> Message | None:
        """The next message; None when the peer said goodbye, or when it is the coordinator
        and it stayed silent past its heartbeat timeout (a hung or cut-off coordinator is a
        lost one: the caller frees its sequences)."""
        timeout = self._heartbeat_timeout_s if channel is self._coordinator else None
        try:
            async with asyncio.timeout(timeout):
                return await channel.recv()
        except TimeoutError:
            log.warning(
                "stage %d: no word from the coordinator at %s for %.1f s; dropping it and its "
                "sequences", self.spec.index, channel.peer_address, timeout,
            )  # fmt: skip
            return None
        except ChannelClosedError as exc:
            if exc.clean:
                return None
            raise

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
            await send_reply(channel, await self._configure(channel, command))
        elif isinstance(command, Admit):
            await send_reply(channel, self._admit(command, message.tensor))
        elif isinstance(command, Release):
            # The budget frees at once, as for Forget: the coordinator gives the sequence's slot
            # to a waiting request right after, whose admission may arrive before the compute
            # loop reaches this release (it was refused "already holds 64 sequences" at a full
            # --parallel). A kept prefix is counted at once too; the caches go in order.
            self.kv.release(command.seq)
            if command.keep is not None:
                self.kv.pin(command.keep, command.keep_tokens)
            self.clock.set_active(len(self.kv.reserved), time.monotonic())
            await self._work.put(ReleaseWork(command.seq, command.keep, command.keep_tokens))
        elif isinstance(command, Forget):
            # The budget frees at once (an admission may follow on this channel right away);
            # the caches go in order on the compute loop.
            for entry in command.entries:
                self.kv.unpin(entry)
            await self._work.put(ForgetWork(tuple(command.entries)))
        elif isinstance(command, Status):
            await send_reply(channel, self.status(command.rid))
        elif isinstance(command, Admission):
            self.admitting = command.open
            self.elastic_state = command.state
            await send_reply(channel, Ack(rid=command.rid))
        elif isinstance(command, Reassign):
            # Loading takes long; this channel keeps answering status meanwhile.
            self._side_tasks.spawn(self._reassign(channel, command), name="stage-reassign")
        elif isinstance(command, Identify):
            await send_reply(channel, self.identify(command.rid))
        elif isinstance(command, PrepareCheck | PrepareData | PrepareCommit):
            await self._model_command(channel, command, message.tensor)
        elif isinstance(command, AdapterLoad | AdapterUnload):
            # Reading an adapter takes a while; the channel keeps answering meanwhile.
            self._side_tasks.spawn(self._adapter_command(channel, command), name="stage-adapter")
        elif isinstance(command, Heartbeat):
            pass  # receiving it was the point: the deadline in _receive starts again
        elif isinstance(command, TraceDump):
            # Events can be many: they travel as a JSON byte tensor, not as metadata.
            events = self.trace.take()
            if isinstance(self.runner, MirroredRunner):  # each rank's track too
                events += await self.mlx.run(self.runner.follower_events)
            payload = np.frombuffer(json.dumps(events).encode(), dtype=np.uint8)
            await send_reply(channel, TraceReply(rid=command.rid), payload)

    def _arrived(self, sent_at: float | None, message: Message) -> None:
        nbytes = message.tensor.nbytes if message.tensor is not None else 0
        if sent_at is not None:
            self.latency.observe(time.time() - sent_at)
        self.trace.instant("activation_recv", self.spec.index, bytes=nbytes, direction="recv")

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
                # The accounting changed when the release arrived (_dispatch).
                if item.keep is None or not await self._keep_here(item):
                    if item.keep is not None:
                        self.kv.unpin(item.keep)  # not kept after all
                    await self._release_here(item.seq)
            elif isinstance(item, ForgetWork):
                for entry in item.entries:
                    if self.runner is not None:
                        await self.mlx.run(functools.partial(self.runner.forget, entry))
            elif isinstance(item, ReleaseAllWork):
                self._failed.clear()
                self.kv.clear()
                self.clock.set_active(0, time.monotonic())
                if self.runner is not None:
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
            self._threads.before_pass(False)
            x = from_wire(tensor)
            if meta.cached is not None:
                self._layers().start_from(meta.cached[0], meta.seq, meta.cached[1])
            if sample:
                return self._layers().forward_and_sample(meta.seq, x, meta.logprobs)
            out = to_wire(self._layers().forward(meta.seq, x))
            for seq in meta.forks or ():
                self._layers().fork(meta.seq, seq)
            return out

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
                top = list(result.top) if result.top is not None else None
                out = TokenMeta(seq=meta.seq, step=meta.step, logprob=result.logprob, top=top)
                await self._out.put((MessageKind.TOKENS, out, token))
            return
        await self._out.put((MessageKind.ACTIVATION, meta, result))

    async def _keep_here(self, item: ReleaseWork) -> bool:
        """Keep a released sequence's caches as a prompt-cache entry (False: not kept)."""
        if self.runner is None or item.keep is None:
            return False
        keep = functools.partial(self.runner.keep, item.seq, item.keep, item.keep_tokens)
        try:
            return bool(await self.mlx.run(keep))
        except Exception as exc:  # the entry is simply not there: its reuse falls back
            log.warning("stage %d: cannot keep %s: %s", self.spec.index, escape(item.seq), exc)
            return False

    async def _release_here(self, seq: str) -> None:
        if self.runner is not None:
            await self.mlx.run(functools.partial(self.runner.release, seq))

    def _check_ring(self) -> None:
        if isinstance(self.runner, MirroredRunner) and self.runner.broken:
            self.rank_lost("a tensor-parallel rank is gone")

    def rank_lost(self, why: str) -> None:
        """A tensor-parallel rank of this stage is gone: nothing more computes here until the
        stage's ranks start again together (whoever runs this node restarts it)."""
        if isinstance(self.runner, MirroredRunner):
            self.runner.broken = True
        if not self.ring_lost.is_set():
            log.error("stage %d: %s; this stage stops", self.spec.index, why)
        self.ring_lost.set()

    async def _sequence_failed(self, seq: str, exc: Exception) -> None:
        self._check_ring()
        self.stats.sequence_failures += 1
        log.error("stage %d: sequence %s failed: %s", self.spec.index, escape(seq), exc)
        self._failed.add(seq)
        await self._release_here(seq)
        failure = SequenceFailure(seq=seq, stage=self.spec.index, message=clip(str(exc), 1000))
        await self._out.put((MessageKind.ERROR, failure, None))

    async def _forward_group(self, meta: BatchForwardMeta, tensor: Any) -> None:
        started = time.monotonic()
        last = self.spec.has_lm_head

        def run() -> Any:
            self._threads.before_pass(meta.solo)
            x = from_wire(tensor)
            if x.shape[0] != len(meta.seqs):
                raise ValueError(f"{x.shape[0]} rows for {len(meta.seqs)} sequences")
            if last:
                return self._layers().forward_group_and_sample(
                    meta.group, meta.seqs, x, meta.logprobs
                )
            return to_wire(self._layers().forward_group(meta.group, meta.seqs, x))

        start_us = now_us()
        try:
            result = await self.mlx.run(run)
        except Exception as exc:
            # This group cannot run here (a malformed batch, a cache kind that cannot batch):
            # drop its state and tell the coordinator, which fails its requests cleanly.
            log.error("stage %d: micro-batch %s failed: %s", self.spec.index, meta.group, exc)
            self._check_ring()
            for seq in meta.seqs:
                await self._release_here(seq)
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
                coordinator = self._coordinator
                if target is self._downstream and coordinator is not None:
                    # The next stage is unreachable from here: the sequences in flight cannot
                    # go on. Dropping the coordinator's link starts its failover, which
                    # rebuilds the chain (and this stage's link to whoever is next).
                    await coordinator.close()
