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
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from mlxppd.core.config.cluster import ClusterConfig, Node
from mlxppd.core.errors import ConfigurationError, TemporaryError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.model_identity import IdentityCheck
from mlxppd.core.prompt_cache import PromptIndex, Reuse
from mlxppd.core.protocol.control import (
    Ack,
    Configure,
)
from mlxppd.core.strict import StrictModel
from mlxppd.runtime.backends.contract import (
    BackendUnavailable,
    SamplingParams,
    SequenceFailed,
    TokenEvent,
)
from mlxppd.runtime.coordinator.adapter_changes import AdapterOps
from mlxppd.runtime.coordinator.adapter_registry import AdapterRegistry
from mlxppd.runtime.coordinator.control_client import BadReplyError, ControlClient
from mlxppd.runtime.coordinator.identity_check import IdentityReference
from mlxppd.runtime.coordinator.link_reader import LinkReader
from mlxppd.runtime.coordinator.micro_batcher import MicroBatcher
from mlxppd.runtime.coordinator.prompt_sender import PromptSender
from mlxppd.runtime.coordinator.recovery import (
    FailoverEvent,
    FailoverSettings,
    PipelineInterrupted,
    Recovery,
)
from mlxppd.runtime.coordinator.shared_prefill import SharedPrefill
from mlxppd.runtime.coordinator.speed_meter import SpeedMeter
from mlxppd.runtime.coordinator.stage_link import StageLink
from mlxppd.runtime.coordinator.stage_ops import StageOps
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.trace import TraceBuffer, TraceFile
from mlxppd.wire.errors import ChannelClosedError
from mlxppd.wire.tasks import spawn, stop_tasks
from mlxppd.wire.transport import Transport

log = logging.getLogger("mlxppd.coordinator")

REPLY_TIMEOUT_S = 30.0
ReplyT = TypeVar("ReplyT", bound=StrictModel)


class Coordinator(StageOps, LinkReader, PromptSender, AdapterOps):
    def __init__(
        self,
        cluster: ClusterConfig,
        transport: Transport,
        tokenizer: Any,
        model_id: str,
        *,
        connect_timeout_s: float = 60.0,
        micro_batch_size: int = 0,
        parallel: int = 64,
        metrics: PipelineMetrics | None = None,
        trace_path: Path | None = None,
        plan: tuple[LayerRange, ...] | None = None,
        failover: FailoverSettings | None = None,
        identity: IdentityReference | None = None,
        prompt_cache: int = 8,
    ) -> None:
        self.cluster = cluster
        # The cluster's copy: stages are checked against it (stage_ops.verify_identities).
        self.identity = identity
        self.identity_checks: list[IdentityCheck] = []
        #: the prompt prefixes every stage keeps (None or capacity 0: none kept)
        self.prompts = PromptIndex(prompt_cache) if prompt_cache else None
        #: the per-request adapters served now (``adapter_registry.py``)
        self.adapters = AdapterRegistry.of(cluster)
        # None: a lost stage fails every open request (as without [cluster.failover]).
        self.failover = failover
        self._recovery: asyncio.Task[None] | None = None
        self._recovered = asyncio.Event()
        self._recovered.set()
        self._heartbeat: asyncio.Task[None] | None = None
        #: every lost stage and what became of it, newest last (status shows them)
        self.failovers: deque[FailoverEvent] = deque(maxlen=64)
        self._micro_batch_size = micro_batch_size
        self._recovering = ""
        # The layer ranges the stages must hold; sent with every admission so a stage that
        # holds others (mid-reload) refuses instead of computing the wrong layers.
        self.plan = plan
        #: the plan of the cluster file, which a restarted stage holds again
        self.file_plan = plan
        self.transport = transport
        self._tokenizer = tokenizer
        self._model_id = model_id
        if model_id in self.adapters.names():
            raise ConfigurationError(
                f"an adapter is named {model_id!r}, the base model's name; rename it",
                source="[[adapters]]",
            )
        self._connect_timeout_s = connect_timeout_s
        self._links: list[StageLink] = []
        #: stages whose link failed under the pipeline serving now (their cards show it)
        self.lost_nodes: set[str] = set()
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
        # 1: no micro-batches; 0: auto (micro_batcher.py)
        stages = len(cluster.pipeline_nodes())
        self.meter = SpeedMeter(stages)
        self._batcher = (
            MicroBatcher(micro_batch_size, self._send_group, stages)
            if micro_batch_size != 1
            else None
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, *, warmup: bool = True) -> None:
        for node in self.cluster.pipeline_nodes():
            self._links.append(await self.open_link(node, self._connect_timeout_s))
        await self.configure_chain(self._links)
        if self.failover is not None:
            self._heartbeat = spawn(self._heartbeats(), name="coordinator-heartbeat")
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

    async def open_link(self, node: Node, timeout_s: float = 0.0) -> StageLink:
        """A link to ``node`` with its reader running; retried for ``timeout_s`` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                channel = await self.transport.connect(node.host, node.port, expected_peer=node.id)
                break
            except TemporaryError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)
        link = StageLink(node, channel, ControlClient(channel, REPLY_TIMEOUT_S))
        link.reader = spawn(self._read(link), name=f"read-{node.id}")
        return link

    async def drop_links(self, links: list[StageLink]) -> None:
        """Close ``links``: each stage frees the KV of every sequence this coordinator sent."""
        for link in links:
            link.alive = False
            if link.reader is not None:
                link.reader.cancel()
            await link.channel.close()
        await stop_tasks(*(link.reader for link in links), cancel=False, ignore_errors=True)

    async def configure_chain(self, links: list[StageLink]) -> None:
        """Tell each stage where its output goes (and how often to say it is alive), once
        every stage has shown it serves the cluster's model."""
        await self.verify_identities(links)
        if self.prompts is not None:
            self.prompts.clear()  # a new chain: no stage holds the old chain's entries
        f = self.failover
        for i, link in enumerate(links):
            nxt = links[i + 1].node if i + 1 < len(links) else None
            configure = Configure(
                next_host=nxt.host if nxt else None,
                next_port=nxt.port if nxt else None,
                next_node=nxt.id if nxt else None,
                trace=self.trace.enabled,
                heartbeat_interval_s=f.heartbeat_interval_s if f else None,
                heartbeat_timeout_s=f.heartbeat_timeout_s if f else None,
            )
            reply = await self.ask(link, configure, Ack)
            link.configured = True
            if not reply.ok:
                raise TemporaryError(
                    f"stage {link.node.id} could not reach {nxt.id if nxt else '?'}: {reply.error}"
                )

    def chain_nodes(self) -> list[Node]:
        """The nodes of the pipeline in stage order (after a failover, not the TOML's)."""
        return [link.node for link in self._links]

    async def ask(
        self, link: StageLink, command: StrictModel, reply: type[ReplyT],
        timeout_s: float = REPLY_TIMEOUT_S,
    ) -> ReplyT:  # fmt: skip
        """A request on one link, outside the pipeline's failure handling (recovery uses it)."""
        return await link.control.ask(command, reply, timeout_s=timeout_s)

    async def close(self) -> None:
        await stop_tasks(self._poller, self._heartbeat, self._recovery)
        if not self._recovered.is_set():  # requests waiting for a recovery end now
            self._broken = self._broken or "the coordinator stopped during a failover"
            self._recovered.set()
        await self.flush_trace()
        self._ready = False
        await self.drop_links(self._links)
        self._links.clear()

    # -- GenerationBackend ---------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def connected(self) -> bool:
        """Every stage link is up, or a failover is finding a new pipeline (False once the
        pipeline is lost for good: whoever runs this coordinator must reconnect)."""
        if not self._recovered.is_set():
            return self._broken is None
        return self._broken is None and all(link.alive for link in self._links)

    def link_alive(self, node_id: str) -> bool:
        return any(link.alive for link in self._links if link.node.id == node_id)

    def generate_choices(
        self, request_id: str, prompt: list[int], params: Sequence[SamplingParams]
    ) -> list[AsyncIterator[TokenEvent]]:
        """The ``n`` choices of one prompt, its prefill computed once (``shared_prefill.py``)."""
        seqs = [f"{request_id}.{next(self._seq)}" for _ in params]
        share = SharedPrefill(seqs) if len(params) > 1 and len(prompt) > 1 else None
        return [
            self.generate(request_id, prompt, p, seq=q, share=share)
            for p, q in zip(params, seqs, strict=True)
        ]

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        seq: str | None = None,
        share: SharedPrefill | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """``share``: this choice leads or follows its prompt's shared prefill."""
        seq = seq or f"{request_id}.{next(self._seq)}"
        if share is not None and seq != share.leader_seq:
            # Wait for the leader's head before taking a slot (the leader may need one).
            if await share.source() is None:
                share = None  # it failed first: prefill alone
        try:
            await self._await_recovery()
        except BaseException:
            _leader_gone(share, seq)
            raise
        if not prompt:
            raise ValueError("the prompt is empty")
        self.trace.instant("batch_arrival", 0, seq=seq, prompt_tokens=len(prompt))
        self.waiting += 1
        try:
            await self._slots.acquire()
        except BaseException:
            _leader_gone(share, seq)
            raise
        finally:
            self.waiting -= 1
        try:
            self.adapters.begin(params.adapter)
        except BaseException:
            self._slots.release()
            _leader_gone(share, seq)
            raise
        self.active += 1
        started = last = time.monotonic()
        produced = 0
        try:
            async for item in self._replayed(seq, prompt, params, share):
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
            self.adapters.end(params.adapter)
            self._slots.release()

    async def _replayed(
        self, seq: str, prompt: list[int], params: SamplingParams,
        share: SharedPrefill | None = None,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """The sequence's tokens; a stage lost under it pauses it, and once the pipeline is
        back it is admitted again with prompt + the tokens sent so far, going on from there."""
        if self.failover is not None and params.temperature > 0 and params.seed is None:
            # A replay must draw what the first run would have: fix the seed now.
            params = replace(params, seed=secrets.randbits(64))
        produced: list[int] = []
        tag = params.adapter or ""
        reuse = self.prompts.match(prompt, tag) if self.prompts is not None and not share else None
        for attempt in itertools.count():
            try:
                # A replay runs on a new chain, which holds none of the old chain's entries.
                async for item in self._generate(
                    f"{seq}~{attempt}" if attempt else seq, [*prompt, *produced], params,
                    len(produced), None if attempt else share, None if attempt else reuse,
                ):  # fmt: skip
                    produced.append(item.token)
                    yield item
                return
            except _CacheMiss:
                # A stage lacks the kept prefix (restarted, or it could not cut it): forget
                # it everywhere and compute the prompt in full.
                assert reuse is not None
                await self.forget_prompts([reuse.entry])
                reuse = None
            except PipelineInterrupted:
                await self._await_recovery()
                log.info("coordinator: replaying %s from token %d", seq, len(produced))
                if self.metrics is not None:
                    self.metrics.sequences_replayed.inc()

    async def _await_recovery(self) -> None:
        """Wait out a failover in progress; raise when the pipeline is down."""
        if not self._recovered.is_set():
            await self._recovered.wait()
        if self._broken is not None:
            raise BackendUnavailable(f"the pipeline is down: {self._broken}")

    async def _generate(
        self, seq: str, prompt: list[int], params: SamplingParams, done: int = 0,
        share: SharedPrefill | None = None, reuse: Reuse | None = None,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """One run of a sequence whose first ``done`` tokens were sent already (a replay);
        ``share``: its prompt's shared prefill (``shared_prefill.py``)."""
        params = replace(params, max_tokens=params.max_tokens - done)
        try:
            await self._admit(seq, prompt, params, first_draw=done)
        except BaseException:
            _leader_gone(share, seq)
            if share is not None and seq != share.leader_seq:
                await self._release(seq)  # the copies of the leader's head it holds
            raise
        queue: asyncio.Queue[TokenEvent | Exception] = asyncio.Queue()
        self._queues[seq] = queue
        try:
            step = await self._prefill(seq, prompt, params, share, reuse)
            tokens: list[int] = []
            final = False
            pending: asyncio.Future[TokenEvent] | None = None
            for produced in range(params.max_tokens):
                if pending is None:
                    got = await queue.get()
                    if isinstance(got, SequenceFailed) and reuse is not None and not produced:
                        raise _CacheMiss() from got
                    if isinstance(got, Exception):
                        raise got
                    item = got
                else:
                    item = await pending
                self.meter.token(seq)
                if produced == 0 and reuse is not None:
                    item = replace(item, cached=reuse.tokens)
                tokens.append(item.token)
                eos = item.token in self._eos()
                if produced + 1 < params.max_tokens and not eos:
                    # Queue the next step before handing this token out: the pipeline works
                    # while the caller detokenizes and streams.
                    if self._batcher is not None and not params.top_logprobs:
                        # Decode steps join a micro-batch; the prefill ran on its own (and a
                        # sequence reporting top logprobs decodes alone: they ride on TokenMeta).
                        pending = self._batcher.submit(seq, item.token, params.logprobs)
                    else:
                        step += 1
                        await self._send_input(seq, step, [item.token], True, params.logprobs)
                # The last token: nothing more runs, so the caches hold prompt + all but it.
                final = eos or produced + 1 == params.max_tokens
                if final and self._batcher is not None:
                    # Out of its micro-batch now, not when the caller closes this iterator:
                    # a caller may stop reading at EOS, and the group waits for every member.
                    self._batcher.leave(seq)
                yield item
                if eos:
                    return
        finally:
            self._queues.pop(seq, None)
            self.meter.ended(seq)
            if self._batcher is not None:
                self._batcher.leave(seq)
            keep = (*prompt, *tokens[:-1]) if final else None
            await self._release(seq, keep, params.adapter or "")

    # -- internals -----------------------------------------------------------------------------

    def _eos(self) -> set[int]:
        return set(getattr(self._tokenizer, "eos_token_ids", ()) or ())

    async def _request(
        self,
        link: StageLink,
        command: StrictModel,
        reply: type[ReplyT],
        timeout_s: float = REPLY_TIMEOUT_S,
        payload: Any = None,
    ) -> ReplyT:
        with self._answering(link):
            return await link.control.ask(command, reply, timeout_s=timeout_s, payload=payload)

    @contextlib.contextmanager
    def _answering(self, link: StageLink) -> Iterator[None]:
        """A stage that does not answer, or answers nonsense, breaks the pipeline."""
        try:
            yield
        except (ChannelClosedError, TimeoutError, BadReplyError) as exc:
            self._fail(link, f"stage {link.node.id} did not answer: {exc or 'timeout'}")
            raise self._lost("a stage did not answer") from None

    def _fail(self, link: StageLink, reason: str) -> None:
        if not link.alive:
            return
        link.alive = False
        self.lost_nodes.add(link.node.id)
        link.control.fail(BackendUnavailable(reason))
        if link not in self._links or not self._recovered.is_set():
            return  # a link of a recovery in progress, or one it is replacing
        if self.failover is not None and self._ready and self._broken is None:
            self._begin_recovery(link, reason)
            return
        if self._broken is None:
            self._broken = reason
            log.error("coordinator: %s; failing %d open requests", reason, len(self._queues))
        for queue in self._queues.values():
            queue.put_nowait(BackendUnavailable(reason))
        if self._batcher is not None:
            self._batcher.fail(BackendUnavailable(reason))
        for each in self._links:
            each.control.fail(BackendUnavailable(reason))

    def _lost(self, reason: str) -> Exception:
        """What a request sees when a link fails under it: a pause, or the end."""
        if not self._recovered.is_set():
            return PipelineInterrupted(reason)
        return BackendUnavailable(self._broken or reason)

    def _begin_recovery(self, link: StageLink, reason: str) -> None:
        lost = self._links.index(link)
        self._recovering = f"lost stage {lost} ({link.node.id}): {reason}"
        log.error("coordinator: %s; %d sequences wait for a new pipeline", self._recovering,
                  len(self._queues))  # fmt: skip
        self._recovered.clear()
        interrupted = PipelineInterrupted(self._recovering)
        for queue in self._queues.values():
            queue.put_nowait(interrupted)
        if self._batcher is not None:
            self._batcher.fail(interrupted)
        for each in self._links:
            each.control.fail(interrupted)
        self._recovery = spawn(self._recover(lost, reason, len(self._queues)), name="failover")

    async def _recover(self, lost: int, reason: str, waiting: int) -> None:
        assert self.failover is not None
        node = self._links[lost].node
        recovery = Recovery(self, self.failover, lost)
        await self.drop_links(self._links)
        event, new = await recovery.attempt(reason, waiting)
        if new is not None:
            self.install(new.links, new.plan)
        else:
            self._broken = f"lost stage {lost} ({node.id}): {reason}; {event.detail}"
            self._recovery = spawn(recovery.until_back(), name="failover-retry")
        self.failovers.append(event)
        if self.metrics is not None:
            self.metrics.record_failover(event)
        self._recovered.set()

    def install(self, links: list[StageLink], plan: tuple[LayerRange, ...] | None) -> None:
        """Serve on a new pipeline (after a recovery): its links and the plan they hold."""
        self._links, self.plan, self._broken = links, plan, None
        self.lost_nodes = set()
        self.meter = SpeedMeter(len(links))
        if self._batcher is not None:  # the old groups' caches went with the old pipeline
            size = self._micro_batch_size
            self._batcher = MicroBatcher(size, self._send_group, len(links))


def _leader_gone(share: SharedPrefill | None, seq: str) -> None:
    """A leader that fails before sending its head lets its followers prefill alone."""
    if share is not None and seq == share.leader_seq:
        share.head_done(None)


class _CacheMiss(Exception):
    """A stage could not start a sequence from its kept prefix: run it without."""
