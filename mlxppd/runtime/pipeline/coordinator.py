"""The coordinator: drives the pipeline of remote stages; runs no stage itself.

It connects to every stage in ascending order, tells each where its output goes, and then
serves requests: coordinated KV admission (dry run on every stage, then commit), the prompt into
stage 0 (all but the last token as prefill, as mlx-lm does, then one step per token), and the
sampled tokens back from the last stage. Every active sequence has its own step in flight, so
with several requests all stages work at once. A lost stage fails every open request and turns
the health check red.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from mlxppd.core.config.cluster import ClusterConfig, Node
from mlxppd.core.errors import TemporaryError
from mlxppd.core.kv_admission import AdmissionDiagnostic, RejectReason
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.protocol.control import (
    Ack,
    Admission,
    Admit,
    AdmitReply,
    Configure,
    Reassign,
    ReassignReply,
    Release,
    StageReport,
    Status,
)
from mlxppd.core.protocol.pipeline import (
    BatchTokenMeta,
    GroupFailure,
    SequenceFailure,
    TokenMeta,
)
from mlxppd.core.strict import StrictModel
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.trace import TraceBuffer, TraceFile
from mlxppd.runtime.pipeline.backend import (
    AdmissionClosed,
    AdmissionRejected,
    BackendUnavailable,
    Health,
    RequestRefused,
    SamplingParams,
    SequenceFailed,
    TokenEvent,
)
from mlxppd.runtime.pipeline.control_client import BadReplyError, ControlClient
from mlxppd.runtime.pipeline.micro_batcher import MicroBatcher
from mlxppd.runtime.pipeline.stage_trace import stage_trace_events
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import ChannelClosedError, FrameError
from mlxppd.wire.tasks import spawn, stop_tasks
from mlxppd.wire.transport import Transport

log = logging.getLogger("mlxppd.coordinator")

PREFILL_STEP_SIZE = 2048
REPLY_TIMEOUT_S = 30.0
ReplyT = TypeVar("ReplyT", bound=StrictModel)


@dataclass
class _StageLink:
    node: Node
    channel: SecureChannel
    control: ControlClient
    reader: asyncio.Task[None] | None = None
    alive: bool = True


class LayerMoveError(TemporaryError):
    """Moving the stages to new layer ranges failed; ``refusals`` is (stage, error) per stage
    that refused. After a refused prepare every stage keeps its old range; after a failed
    commit (``committed``) a stage is broken, not busy."""

    def __init__(self, message: str, refusals: list[tuple[int, str]], *, committed: bool):
        super().__init__(message)
        self.refusals = refusals
        self.committed = committed


class Coordinator:
    def __init__(
        self,
        cluster: ClusterConfig,
        transport: Transport,
        tokenizer: Any,
        model_id: str,
        *,
        connect_timeout_s: float = 60.0,
        micro_batch_size: int = 1,
        parallel: int = 64,
        metrics: PipelineMetrics | None = None,
        trace_path: Path | None = None,
        plan: tuple[LayerRange, ...] | None = None,
    ) -> None:
        self.cluster = cluster
        # The layer ranges the stages must hold; sent with every admission so a stage that
        # holds others (mid-reload) refuses instead of computing the wrong layers.
        self.plan = plan
        self.transport = transport
        self._tokenizer = tokenizer
        self._model_id = model_id
        self._connect_timeout_s = connect_timeout_s
        self._links: list[_StageLink] = []
        self._queues: dict[str, asyncio.Queue[TokenEvent | Exception]] = {}
        self._seq = itertools.count()
        self._ready = False
        self._broken: str | None = None
        # --parallel: sequences generating at once; later requests wait for a slot.
        self._slots = asyncio.Semaphore(parallel)
        self.waiting = 0
        self.active = 0
        self.metrics = metrics
        self._poller: asyncio.Task[None] | None = None
        self._trace_file = TraceFile(trace_path) if trace_path is not None else None
        self.trace = TraceBuffer(pid="coordinator", enabled=trace_path is not None)
        if metrics is not None:
            metrics.bind(
                queue_depth=lambda: self.waiting,
                active=lambda: self.active,
                wire=transport.stats.snapshot,
                rdma_fallbacks=self._rdma_fallbacks,
            )
        self._batcher = (
            MicroBatcher(micro_batch_size, self._send_group) if micro_batch_size > 1 else None
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, *, warmup: bool = True) -> None:
        for node in self.cluster.stage_nodes():
            channel = await self._connect(node)
            link = _StageLink(node, channel, ControlClient(channel, REPLY_TIMEOUT_S))
            link.reader = spawn(self._read(link), name=f"read-{node.id}")
            self._links.append(link)
        nodes = [link.node for link in self._links]
        for i, link in enumerate(self._links):
            nxt = nodes[i + 1] if i + 1 < len(nodes) else None
            configure = Configure(
                next_host=nxt.host if nxt else None,
                next_port=nxt.port if nxt else None,
                next_node=nxt.id if nxt else None,
                trace=self.trace.enabled,
            )
            reply = await self._request(link, configure, Ack)
            if not reply.ok:
                raise TemporaryError(
                    f"stage {link.node.id} could not reach stage {nxt.id if nxt else '?'}: "
                    f"{reply.error}"
                )
        if warmup:
            await self.warm()
        self._ready = True
        if self.metrics is not None:
            self._poller = spawn(self._poll_stages(), name="poll-stages")
        log.info("coordinator: %d stages connected and warm", len(self._links))

    async def warm(self) -> None:
        """One 2-token request through every stage (compiles kernels, proves the chain)."""
        prompt = [int(t) for t in self._tokenizer.encode("Hello")] or [0]
        async for _ in self.generate("warmup", prompt, SamplingParams(max_tokens=2)):
            pass

    async def align_stages(self, timeout_s: float = 600.0) -> bool:
        """Bring every stage to ``plan`` (after a reconnect, stages may still hold the ranges
        of an earlier elastic repartition). True when something had to move."""
        if self.plan is None:
            return False
        want = [(r.start, r.end) for r in self.plan]
        reports = await self.stage_status()
        if [r.layers for r in reports] == want:
            return False
        await self.move_stages(self.plan, timeout_s)
        return True

    async def move_stages(
        self, target: tuple[LayerRange, ...], prepare_timeout_s: float
    ) -> list[ReassignReply]:
        """The two-phase move to new layer ranges, the one place it is written: every stage
        prepares its new range beside the old one (loading only the layers it gains), then,
        only when all are ready, every stage commits; one refusal aborts everywhere. Returns
        the prepare replies (what each stage loaded); the plan becomes ``target``."""
        replies = await self.reassign("prepare", target, prepare_timeout_s)
        refused = [(i, str(r.error)) for i, r in enumerate(replies) if not r.ok]
        if refused:
            with contextlib.suppress(BackendUnavailable):
                await self.reassign("abort", target, 30.0)
            errors = "; ".join(error for _, error in refused)
            raise LayerMoveError(
                f"stages could not load the planned layers: {errors}", refused, committed=False
            )
        committed = await self.reassign("commit", target, 60.0)
        failed = [(i, str(r.error)) for i, r in enumerate(committed) if not r.ok]
        if failed:
            # A commit is a pointer swap; failing here means a stage is broken, not busy.
            raise LayerMoveError(
                f"a stage failed to switch layers: {failed}", failed, committed=True
            )
        self.plan = target
        return replies

    async def _poll_stages(self, every_s: float = 1.0) -> None:
        """Stage reports for the metrics: one scrape of the coordinator covers the cluster."""
        assert self.metrics is not None
        while self._broken is None:
            with contextlib.suppress(BackendUnavailable):
                reports = await self.stage_status()
                self.metrics.record_stage_reports(time.monotonic(), reports)
            await asyncio.sleep(every_s)

    def _rdma_fallbacks(self) -> int:
        state = getattr(self.transport, "state", None)
        if state is None:
            return 0
        return int(state.fallback_reason is not None) + int(state.peer_fallbacks)

    async def flush_trace(self) -> bool:
        """Merge every node's events into the trace file, once (a second call does nothing)."""
        if self._trace_file is None or self._trace_file.written:
            return False
        events = self.trace.take()
        for link in self._links:
            if link.alive:
                with contextlib.suppress(BackendUnavailable), self._answering(link):
                    events.extend(await stage_trace_events(link.control))
        return self._trace_file.flush(events)

    async def _connect(self, node: Node) -> SecureChannel:
        deadline = asyncio.get_running_loop().time() + self._connect_timeout_s
        while True:
            try:
                return await self.transport.connect(node.host, node.port, expected_peer=node.id)
            except TemporaryError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        await stop_tasks(self._poller)
        await self.flush_trace()
        self._ready = False
        for link in self._links:
            if link.reader is not None:
                link.reader.cancel()
            await link.channel.close()
        await stop_tasks(*(link.reader for link in self._links), cancel=False, ignore_errors=True)
        self._links.clear()

    # -- GenerationBackend ---------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def health(self) -> Health:
        stages = tuple(
            {"stage": i, "node": link.node.id, "address": link.node.address, "alive": link.alive}
            for i, link in enumerate(self._links)
        )
        if self._broken is not None:
            return Health(ready=False, detail=self._broken, stages=stages)
        if not self._ready:
            return Health(
                ready=False, detail="starting: connecting and warming stages", stages=stages
            )
        return Health(ready=True, detail="all stages connected", stages=stages)

    async def stage_status(self) -> list[StageReport]:
        """Each stage's own report (KV use, busy fraction, forwards)."""
        return [await self._request(link, Status(), StageReport) for link in self._links]

    async def set_stage_admission(self, open_: bool, state: str) -> None:
        """Open or close admission on every stage (an elastic drain), reporting ``state``."""
        command = Admission(open=open_, state=state)
        await asyncio.gather(*(self._request(link, command, Ack) for link in self._links))

    async def reassign(
        self, phase: Literal["prepare", "commit", "abort"], plan: tuple[LayerRange, ...],
        timeout_s: float,
    ) -> list[ReassignReply]:  # fmt: skip
        """One phase of an elastic resume on every stage; each stage's reply, in stage order."""
        command = Reassign(phase=phase, plan=[(r.start, r.end) for r in plan])
        return list(
            await asyncio.gather(
                *(self._request(link, command, ReassignReply, timeout_s) for link in self._links)
            )
        )

    @property
    def connected(self) -> bool:
        """Every stage link is up (False once one was lost: the pipeline must reconnect)."""
        return self._broken is None and all(link.alive for link in self._links)

    def link_alive(self, node_id: str) -> bool:
        return any(link.alive for link in self._links if link.node.id == node_id)

    async def stage_reports(self) -> dict[str, StageReport | None]:
        """Each connected stage's report by node id; None for a stage that did not answer."""

        async def one(link: _StageLink) -> StageReport | None:
            if not link.alive:
                return None
            try:
                return await self._request(link, Status(), StageReport)
            except BackendUnavailable:
                return None

        replies = await asyncio.gather(*(one(link) for link in self._links))
        return {link.node.id: reply for link, reply in zip(self._links, replies, strict=True)}

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        if self._broken is not None:
            raise BackendUnavailable(f"the pipeline is down: {self._broken}")
        if not prompt:
            raise ValueError("the prompt is empty")
        seq = f"{request_id}.{next(self._seq)}"
        self.trace.instant("batch_arrival", 0, seq=seq, prompt_tokens=len(prompt))
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.active += 1
        started = last = time.monotonic()
        produced = 0
        try:
            async for item in self._generate(seq, prompt, params):
                now = time.monotonic()
                if self.metrics is not None:
                    if produced == 0:
                        self.metrics.prompt_tokens.inc(len(prompt))
                        self.metrics.ttft.observe(now - started)
                    else:
                        self.metrics.itl.observe(now - last)
                    self.metrics.generation_tokens.inc()
                produced += 1
                last = now
                yield item
        finally:
            self.active -= 1
            self._slots.release()

    async def _generate(
        self, seq: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        await self._admit(seq, prompt, params)
        queue: asyncio.Queue[TokenEvent | Exception] = asyncio.Queue()
        self._queues[seq] = queue
        try:
            step = 0
            head, last = prompt[:-1], prompt[-1:]
            for i in range(0, len(head), PREFILL_STEP_SIZE):
                await self._send_input(seq, step, head[i : i + PREFILL_STEP_SIZE], False, False)
                step += 1
            await self._send_input(seq, step, last, True, params.logprobs)
            pending: asyncio.Future[TokenEvent] | None = None
            for produced in range(params.max_tokens):
                if pending is None:
                    got = await queue.get()
                    if isinstance(got, Exception):
                        raise got
                    item = got
                else:
                    item = await pending
                eos = item.token in self._eos()
                if produced + 1 < params.max_tokens and not eos:
                    # Queue the next step before handing this token out: the pipeline works
                    # while the caller detokenizes and streams.
                    if self._batcher is not None:
                        # Decode steps join a micro-batch; the prefill ran on its own.
                        pending = self._batcher.submit(seq, item.token, params.logprobs)
                    else:
                        step += 1
                        await self._send_input(seq, step, [item.token], True, params.logprobs)
                yield item
                if eos:
                    return
        finally:
            self._queues.pop(seq, None)
            if self._batcher is not None:
                self._batcher.leave(seq)
            await self._release(seq)

    # -- internals -----------------------------------------------------------------------------

    def _eos(self) -> set[int]:
        return set(getattr(self._tokenizer, "eos_token_ids", ()) or ())

    async def _admit(self, seq: str, prompt: list[int], params: SamplingParams) -> None:
        plan = [(r.start, r.end) for r in self.plan] if self.plan is not None else None
        for commit in (False, True):
            command = Admit(
                seq=seq, prompt_tokens=len(prompt), max_tokens=params.max_tokens, commit=commit,
                temperature=params.temperature, top_p=params.top_p, seed=params.seed, plan=plan,
            )  # fmt: skip
            replies = await asyncio.gather(
                *(self._request(link, command, AdmitReply) for link in self._links)
            )
            refusals = [r.refusal(i) for i, r in enumerate(replies)]
            refused = [d for d in refusals if d is not None]
            if refused:
                if commit:  # another request took the room between dry run and commit
                    await self._release(seq)
                diagnostic = refused[0]
                self._rejected(seq, diagnostic)
                if diagnostic.reason in (RejectReason.DRAINING, RejectReason.PLAN_MISMATCH):
                    raise AdmissionClosed(diagnostic.message())
                if diagnostic.reason is RejectReason.INVALID_REQUEST:
                    raise RequestRefused(diagnostic.message())
                raise AdmissionRejected(diagnostic)

    def _rejected(self, seq: str, d: AdmissionDiagnostic) -> None:
        """An OOM diagnostic: one log line, the counter, a trace event."""
        log.warning(
            "admission rejected: %s stage=%d reason=%s required=%d used=%d budget=%d active=%d",
            seq, d.stage_index, d.reason.value, d.required_bytes, d.used_memory_bytes,
            d.budget_bytes, d.active_sequences,
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.rejections.labels(stage=str(d.stage_index), reason=d.reason.value).inc()
        self.trace.instant(
            "admission_reject", 0, seq=seq, stage=d.stage_index, reason=d.reason.value,
            required_bytes=d.required_bytes, available_bytes=d.available_bytes,
        )  # fmt: skip

    async def _release(self, seq: str) -> None:
        for link in self._links:
            if link.alive:
                with contextlib.suppress(ChannelClosedError, FrameError):
                    await link.control.tell(Release(seq=seq))

    async def _send_input(
        self, seq: str, step: int, tokens: list[int], sample: bool, logprobs: bool
    ) -> None:
        link = self._links[0]
        array = np.asarray([tokens], dtype=np.int32)
        meta = {"seq": seq, "step": step, "sample": sample, "logprobs": logprobs}
        try:
            await link.channel.send(MessageKind.ACTIVATION, meta, array)
        except ChannelClosedError as exc:
            self._fail(link, f"stage {link.node.id} is unreachable: {exc}")
            raise BackendUnavailable(self._broken or str(exc)) from None

    async def _send_group(
        self, group: str, seqs: list[str], step: int, tokens: np.ndarray, logprobs: bool
    ) -> None:
        link = self._links[0]
        meta = {"group": group, "seqs": seqs, "step": step, "sample": True, "logprobs": logprobs}
        try:
            await link.channel.send(MessageKind.ACTIVATION, meta, tokens)
        except ChannelClosedError as exc:
            self._fail(link, f"stage {link.node.id} is unreachable: {exc}")
            raise BackendUnavailable(self._broken or str(exc)) from None

    async def _request(
        self,
        link: _StageLink,
        command: StrictModel,
        reply: type[ReplyT],
        timeout_s: float = REPLY_TIMEOUT_S,
    ) -> ReplyT:
        with self._answering(link):
            return await link.control.ask(command, reply, timeout_s=timeout_s)

    @contextlib.contextmanager
    def _answering(self, link: _StageLink) -> Iterator[None]:
        """A stage that does not answer, or answers nonsense, breaks the pipeline."""
        try:
            yield
        except (ChannelClosedError, TimeoutError, BadReplyError) as exc:
            self._fail(link, f"stage {link.node.id} did not answer: {exc or 'timeout'}")
            raise BackendUnavailable(self._broken or "a stage did not answer") from None

    async def _read(self, link: _StageLink) -> None:
        try:
            async for message in link.channel:
                if message.kind is MessageKind.REPLY:
                    link.control.deliver(message)
                elif (
                    message.kind is MessageKind.TOKENS
                    and message.tensor is not None
                    and "group" in message.meta
                    and self._batcher is not None
                ):
                    batch = BatchTokenMeta.model_validate(dict(message.meta))
                    tokens = np.frombuffer(message.tensor.data, dtype=np.int32).tolist()
                    self._batcher.on_tokens(batch.group, batch.seqs, tokens, batch.logprobs)
                elif message.kind is MessageKind.ERROR:
                    self._failed(link, message.meta)
                elif message.kind is MessageKind.TOKENS and message.tensor is not None:
                    meta = TokenMeta.model_validate(dict(message.meta))
                    token = int(np.frombuffer(message.tensor.data, dtype=np.int32)[0])
                    queue = self._queues.get(meta.seq)
                    if queue is not None:
                        queue.put_nowait(TokenEvent(token=token, logprob=meta.logprob))
            self._fail(link, f"stage {link.node.id} closed its connection")
        except (ChannelClosedError, FrameError) as exc:
            self._fail(link, f"lost stage {link.node.id}: {exc}")
        except Exception as exc:
            self._fail(link, f"bad message from stage {link.node.id}: {exc}")

    def _failed(self, link: _StageLink, meta: Any) -> None:
        """A stage could not compute some sequences: their requests fail, nothing else."""
        if "group" in meta:
            group = GroupFailure.model_validate(dict(meta))
            if self._batcher is not None:
                self._batcher.fail_group(group.group, f"stage {link.node.id}: {group.message}")
            return
        failure = SequenceFailure.model_validate(dict(meta))
        queue = self._queues.get(failure.seq)
        if queue is not None:
            queue.put_nowait(
                SequenceFailed(f"stage {failure.stage} failed on this request: {failure.message}")
            )

    def _fail(self, link: _StageLink, reason: str) -> None:
        if not link.alive:
            return
        link.alive = False
        if self._broken is None:
            self._broken = reason
            log.error("coordinator: %s; failing %d open requests", reason, len(self._queues))
        for queue in self._queues.values():
            queue.put_nowait(BackendUnavailable(reason))
        if self._batcher is not None:
            self._batcher.fail(reason)
        for each in self._links:
            each.control.fail(BackendUnavailable(reason))
