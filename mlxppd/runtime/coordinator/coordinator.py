"""The coordinator: drives the pipeline of remote stages; runs no stage itself.

It is a composition of parts, each with one job (docs/architecture.md walks a request through
them): the ``StageChain`` (the links to every stage, in order, and what is asked of all of them
at once), ``SequenceAdmission`` (coordinated KV admission and the prompt index), the
``PromptSender`` (input into stage 0), the ``SequenceRouter`` (tokens back to each sequence, its
micro-batch), ``AdapterChanges`` and, when a stage is lost, one ``Recovery``. Whether it serves
is one state (``core/serving_state.py``): a lost stage pauses every open request while a
failover finds a new pipeline (``[cluster.failover]``), else fails them and turns the health
check red.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from mlxppd.core.config.cluster import ClusterConfig, Node
from mlxppd.core.errors import ConfigurationError, TemporaryError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.model_identity import IdentityCheck
from mlxppd.core.prompt_cache import PromptIndex
from mlxppd.core.protocol.control import ReassignReply, StageReport
from mlxppd.core.serving_state import Serving, ServingEvent, ServingState
from mlxppd.runtime.backends.contract import (
    BackendUnavailable,
    Health,
    SamplingParams,
    TokenEvent,
)
from mlxppd.runtime.coordinator.adapter_changes import AdapterChanges
from mlxppd.runtime.coordinator.adapter_registry import AdapterRegistry
from mlxppd.runtime.coordinator.admission import SequenceAdmission
from mlxppd.runtime.coordinator.chain import REPLY_TIMEOUT_S, StageChain
from mlxppd.runtime.coordinator.control_client import ControlClient
from mlxppd.runtime.coordinator.identity_check import (
    IdentityReference,
    ModelMismatch,
    check_links,
    refuse_mismatches,
)
from mlxppd.runtime.coordinator.layout_restore import LayoutRestorer, drained
from mlxppd.runtime.coordinator.link_reader import LinkReader, send_heartbeats
from mlxppd.runtime.coordinator.prompt_sender import PromptSender
from mlxppd.runtime.coordinator.recovery import (
    ChainBuilder,
    FailoverEvent,
    FailoverSettings,
    PipelineInterrupted,
    Recovery,
)
from mlxppd.runtime.coordinator.sequence_router import SequenceRouter
from mlxppd.runtime.coordinator.sequence_runner import SequenceRunner
from mlxppd.runtime.coordinator.speed_meter import SpeedMeter
from mlxppd.runtime.coordinator.stage_link import StageLink
from mlxppd.runtime.coordinator.stage_trace import stage_trace_events
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.trace import TraceBuffer, TraceFile
from mlxppd.wire.tasks import spawn, stop_tasks
from mlxppd.wire.transport import Transport

log = logging.getLogger("mlxppd.coordinator")


class Coordinator:
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        # The cluster's copy: stages are checked against it (verify_identities).
        self.identity = identity
        self.identity_checks: list[IdentityCheck] = []
        #: the per-request adapters served now (``adapter_registry.py``)
        self.adapters = AdapterRegistry.of(cluster)
        if model_id in self.adapters.names():
            raise ConfigurationError(
                f"an adapter is named {model_id!r}, the base model's name; rename it",
                source="[[adapters]]",
            )
        # None: a lost stage fails every open request (as without [cluster.failover]).
        self.failover = failover
        #: every lost stage and what became of it, newest last (status shows them)
        self.failovers: deque[FailoverEvent] = deque(maxlen=64)
        #: the plan of the cluster file, which a restarted stage holds again
        self.file_plan = plan
        self.transport = transport
        #: the name requests give as ``model`` (the backend contract's)
        self.model_id = model_id
        #: mlx-lm's TokenizerWrapper (the backend contract's)
        self.tokenizer = tokenizer
        self._connect_timeout_s = connect_timeout_s
        self._clock = clock
        self.serving = Serving(since=clock())
        # Set while requests need not wait (any state but RECOVERING).
        self._settled = asyncio.Event()
        self._settled.set()
        #: stages whose link failed under the pipeline serving now (their cards show it)
        self.lost_nodes: set[str] = set()
        #: whether admissions are held above it (a drain, a repartition): no restore then
        self.admission_held: Callable[[], bool] = lambda: False
        self.metrics = metrics
        self._trace_file = TraceFile(trace_path) if trace_path is not None else None
        self.trace = TraceBuffer(pid="coordinator", enabled=trace_path is not None)
        self._compose(plan, micro_batch_size, parallel, prompt_cache)
        self._tasks: dict[str, asyncio.Task[None] | None] = {}
        if metrics is not None:
            metrics.bind(
                queue_depth=lambda: self.waiting,
                active=lambda: self.active,
                wire=transport.stats.snapshot,
                rdma_fallbacks=self._rdma_fallbacks,
            )

    def _compose(
        self, plan: tuple[LayerRange, ...] | None, micro_batch_size: int, parallel: int,
        prompt_cache: int,
    ) -> None:  # fmt: skip
        """The parts, each given what it needs (the serving chain through a getter: a
        recovery replaces it)."""
        # The layer ranges the stages must hold; sent with every admission so a stage that
        # holds others (mid-reload) refuses instead of computing the wrong layers.
        self.chain = StageChain([], plan, self.link_lost)
        stages = len(self.cluster.pipeline_nodes())
        self.meter = SpeedMeter(stages)
        self.sender = PromptSender(lambda: self.chain, lambda: self.meter,
                                   lambda: self.active, self.trace)  # fmt: skip
        self.router = SequenceRouter(micro_batch_size, self.sender.send_group, stages)
        self.admission = SequenceAdmission(
            lambda: self.chain, PromptIndex(prompt_cache) if prompt_cache else None, self.metrics,
            self.trace,
        )  # fmt: skip
        self.adapter_changes = AdapterChanges(
            lambda: self.chain, self.adapters, self.admission, self.identity, self.model_id
        )
        self.runner = SequenceRunner(
            admission=self.admission, sender=self.sender, router=self.router,
            meter=lambda: self.meter, adapters=self.adapters, await_serving=self.await_serving,
            parallel=parallel, eos=set(getattr(self.tokenizer, "eos_token_ids", ()) or ()),
            replays=self.failover is not None, trace=self.trace, metrics=self.metrics,
        )  # fmt: skip
        self._read = LinkReader(
            self.router,
            self.link_lost,
            self.failover.heartbeat_timeout_s if self.failover else None,
        )
        self._build = ChainBuilder(self.open_link, self.link_lost, self.configure_chain)
        self.restorer = None if not self.failover or not self.failover.restore_layout else (
            LayoutRestorer(
                self.failover, self._build, file_nodes=self.cluster.pipeline_nodes,
                serving_nodes=self.chain_nodes,
                serving=lambda: self.serving.state is ServingState.SERVING,
                held=lambda: self.admission_held(), restore=self.restore_layout,
                clock=self._clock,
            )
        )  # fmt: skip

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, *, warmup: bool = True) -> None:
        for node in self.cluster.pipeline_nodes():
            self.chain.links.append(await self.open_link(node, self._connect_timeout_s))
        await self.configure_chain(self.chain)
        if self.failover is not None:
            beats = send_heartbeats(lambda: self.chain, self.failover.heartbeat_interval_s)
            self._tasks["heartbeat"] = spawn(beats, name="coordinator-heartbeat")
            if self.restorer is not None and self.file_plan is not None:
                self._tasks["restore"] = spawn(self.restorer.run(), name="layout-restore")
        if warmup:
            await self.warm()
        self._serve(ServingEvent.START, "all stages connected")
        if self.metrics is not None:
            self._tasks["poller"] = spawn(self._poll_stages(), name="poll-stages")
        log.info("coordinator: %d stages connected and warm", len(self.chain.links))

    async def warm(self) -> None:
        """One 2-token request through every stage (compiles kernels, proves the chain)."""
        prompt = [int(t) for t in self.tokenizer.encode("Hello")] or [0]
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

    async def configure_chain(self, chain: StageChain) -> None:
        """Tell each stage where its output goes (and how often to say it is alive), once
        every stage has shown it serves the cluster's model."""
        await self.verify_identities(chain)
        # A standby that adopted a stage, or a restarted node, holds only the file's adapters.
        await self.adapter_changes.supply(chain)
        self.admission.clear()  # a new chain: no stage holds the old chain's entries
        f = self.failover
        await chain.configure(
            self.trace.enabled,
            f.heartbeat_interval_s if f else None,
            f.heartbeat_timeout_s if f else None,
        )

    async def verify_identities(self, chain: StageChain) -> None:
        """Compare what each stage serves with the cluster's copy; ModelMismatch if any
        differs, holds none, or cannot run the family."""
        if self.identity is None:
            return
        self.identity_checks = await check_links(self.identity, chain.links, chain.ask)
        refuse_mismatches(self.identity_checks)

    async def verify_chain(self) -> None:
        """Check every stage of the chain again (after a layer move or a stage's reload);
        layers that are not the cluster's break the pipeline: nothing is served from them."""
        try:
            await self.verify_identities(self.chain)
        except ModelMismatch as exc:
            self._serve(ServingEvent.BREAK, str(exc))
            raise

    async def close(self) -> None:
        await stop_tasks(*self._tasks.values())
        self._serve(ServingEvent.STOP, "the coordinator stopped")
        # Open sequences end now: none waits out a step that will not come back.
        self.router.fail_all(BackendUnavailable("the coordinator stopped"))
        await self.flush_trace()
        await self.chain.close()
        self.chain.links.clear()

    # -- what the operator and the agent ask of the pipeline -----------------------------------

    @property
    def plan(self) -> tuple[LayerRange, ...] | None:
        """The layer ranges the serving stages hold."""
        return self.chain.plan

    def expect_plan(self, plan: tuple[LayerRange, ...]) -> None:
        """The stages reload ``plan`` themselves (an agent's replan): admit against it. It is
        the file's plan now (a restarted stage holds it; a restore returns to it)."""
        self.chain.plan = plan
        self.file_plan = plan

    @property
    def prompts(self) -> PromptIndex | None:
        return self.admission.prompts

    @property
    def prefill_chunk(self) -> int | None:
        return self.sender.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int | None) -> None:
        self.sender.prefill_chunk = tokens

    def chain_nodes(self) -> list[Node]:
        """The nodes of the pipeline in stage order (after a failover, not the TOML's)."""
        return self.chain.nodes()

    def link_alive(self, node_id: str) -> bool:
        return self.chain.alive(node_id)

    @property
    def connected(self) -> bool:
        """Every stage link is up, or a failover is finding a new pipeline (False once the
        pipeline is lost for good: whoever runs this coordinator must reconnect)."""
        if self.serving.waits:
            return True
        return not self.serving.refuses and all(link.alive for link in self.chain.links)

    def health(self) -> Health:
        stages = tuple(
            {"stage": i, "node": link.node.id, "address": link.node.address, "alive": link.alive}
            for i, link in enumerate(self.chain.links)
        )
        ready = self.serving.state is ServingState.SERVING
        return Health(ready=ready, detail=self.serving.health_detail(), stages=stages)

    async def stage_status(self) -> list[StageReport]:
        """Each stage's own report (KV use, busy fraction, forwards)."""
        return await self.chain.status()

    async def stage_reports(self) -> dict[str, StageReport | None]:
        """Each connected stage's report by node id; None for a stage that did not answer."""
        return await self.chain.reports()

    async def set_stage_admission(self, open_: bool, state: str) -> None:
        """Open or close admission on every stage (an elastic drain), reporting ``state``."""
        await self.chain.set_admission(open_, state)

    async def move_stages(
        self, target: tuple[LayerRange, ...], prepare_timeout_s: float
    ) -> list[ReassignReply]:
        """The chain's two-phase move to ``target`` (``StageChain.move``), then every stage's
        identity checked again."""
        try:
            replies = await self.chain.move(target, prepare_timeout_s)
        finally:
            # A stage that moved has new runners: its prompt-cache entries went with the old.
            await self.admission.forget_all()
        await self.verify_chain()
        return replies

    async def align_stages(self, timeout_s: float = 600.0) -> bool:
        """Bring every stage to ``plan`` (after a reconnect, stages may still hold the ranges
        of an earlier elastic repartition). True when something had to move."""
        if self.plan is None:
            return False
        want = [r.pair for r in self.plan]
        if [r.layers for r in await self.chain.status()] == want:
            return False
        await self.move_stages(self.plan, timeout_s)
        return True

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Hold adapter ``name`` on every stage (``adapter_changes.py``)."""
        return await self.adapter_changes.load(name, path)

    async def unload_adapter(self, name: str, drain_timeout_s: float) -> dict[str, Any]:
        """Drain ``name``'s requests, then drop it on every stage."""
        return await self.adapter_changes.unload(name, drain_timeout_s)

    async def flush_trace(self) -> bool:
        """Merge every node's events into the trace file, once (a second call does nothing)."""
        if self._trace_file is None or self._trace_file.written:
            return False
        events = self.trace.take()
        for link in self.chain.links:
            if link.alive:
                try:
                    events.extend(await stage_trace_events(self.chain, link))
                except BackendUnavailable:
                    pass
        return self._trace_file.flush(events)

    def _rdma_fallbacks(self) -> int:
        state = getattr(self.transport, "state", None)
        if state is None:
            return 0
        return int(state.fallback_reason is not None) + int(state.peer_fallbacks)

    async def _poll_stages(self, every_s: float = 1.0) -> None:
        """Stage reports for the metrics: one scrape of the coordinator covers the cluster."""
        assert self.metrics is not None
        while True:  # until close() ends it: a pipeline lost for good may come back
            if not self.serving.refuses:
                try:
                    reports = await self.stage_status()
                    self.metrics.record_stage_reports(time.monotonic(), reports)
                except BackendUnavailable:
                    pass
            await asyncio.sleep(every_s)

    # -- GenerationBackend ---------------------------------------------------------------------

    def generate_choices(
        self, request_id: str, prompt: list[int], params: Sequence[SamplingParams]
    ) -> list[AsyncIterator[TokenEvent]]:
        """The ``n`` choices of one prompt, its prefill computed once (``shared_prefill.py``)."""
        return self.runner.generate_choices(request_id, prompt, params)

    def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """One sequence's tokens (``sequence_runner.py``)."""
        return self.runner.generate(request_id, prompt, params)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot (--parallel)."""
        return self.runner.waiting

    @property
    def active(self) -> int:
        """Sequences generating now."""
        return self.runner.active

    async def await_serving(self) -> None:
        """Wait out a failover in progress; raise when the pipeline is down."""
        if self.serving.waits:
            await self._settled.wait()
        if self.serving.refuses:
            raise BackendUnavailable(f"the pipeline is down: {self.serving.detail}")

    # -- internals -----------------------------------------------------------------------------

    def _serve(self, event: ServingEvent, detail: str) -> None:
        """The one place the serving state changes."""
        self.serving = self.serving.on(event, detail, self._clock())
        if self.serving.waits:
            self._settled.clear()
        else:
            self._settled.set()

    def link_lost(self, link: StageLink, reason: str) -> Exception:
        """Every chain's error policy: ``link`` failed; what the request on it raises (a pause
        while a failover runs, else the end)."""
        self._fail(link, reason)
        return self._lost_error(link, reason)

    def _lost_error(self, link: StageLink, reason: str) -> Exception:
        """What a request waiting on a lost link raises: a pause when a new pipeline is being
        found (or serves already: the link was the old one's), so the runner replays it;
        otherwise the end."""
        if self.serving.waits:
            return PipelineInterrupted(reason)
        replaced = link not in self.chain.links and self.serving.state is ServingState.SERVING
        if self.failover is not None and replaced:
            return PipelineInterrupted(reason)
        return BackendUnavailable(self.serving.detail if self.serving.refuses else reason)

    def _fail(self, link: StageLink, reason: str) -> None:
        if not link.alive:
            return
        link.alive = False
        state = self.serving.state
        if link not in self.chain.links or state in (ServingState.RECOVERING, ServingState.STOPPED):
            # A link of a recovery in progress, or one it is replacing: its caller decides.
            link.control.fail(self._lost_error(link, reason))
            return
        self.lost_nodes.add(link.node.id)
        if self.failover is not None and state in (ServingState.SERVING, ServingState.RESTORING):
            # The requests waiting on this link (an admission, say) are paused with the
            # others, not failed: they are replayed on the new pipeline.
            self._begin_recovery(link, reason)
            return
        if state is not ServingState.DOWN:
            log.error("coordinator: %s; failing %d open requests", reason, len(self.router.queues))
        self._serve(ServingEvent.LOSE, reason)
        down = BackendUnavailable(reason)
        self.router.fail_all(down)
        for each in self.chain.links:
            each.control.fail(down)

    def _begin_recovery(self, link: StageLink, reason: str) -> None:
        lost = self.chain.links.index(link)
        detail = f"lost stage {lost} ({link.node.id}): {reason}"
        self._serve(ServingEvent.LOSE_RECOVERABLE, detail)
        waiting = self.active  # open sequences, and those caught in their admission
        log.error("coordinator: %s; %d sequences wait for a new pipeline", detail, waiting)
        self._interrupt(PipelineInterrupted(detail))
        self._tasks["recovery"] = spawn(self._recover(lost, reason, waiting), name="failover")

    def _interrupt(self, interrupted: PipelineInterrupted) -> None:
        """Pause every open sequence and every request waiting on a stage: each is replayed
        once a new pipeline serves."""
        self.router.fail_all(interrupted)
        for each in self.chain.links:
            each.control.fail(interrupted)

    async def _recover(self, lost: int, reason: str, waiting: int) -> None:
        assert self.failover is not None
        old = self.chain
        node = old.links[lost].node
        recovery = Recovery.after_loss(
            self._build, self.failover, old, lost, self.cluster.standby_nodes(), self.file_plan
        )
        await old.close()
        event, new = await recovery.attempt(reason, waiting)
        self.failovers.append(event)
        if self.metrics is not None:
            self.metrics.record_failover(event)
        if new is not None:
            self.install(new.chain)
            return
        self._serve(
            ServingEvent.GIVE_UP, f"lost stage {lost} ({node.id}): {reason}; {event.detail}"
        )
        self._tasks["recovery"] = spawn(self._until_back(recovery), name="failover-retry")

    async def restore_layout(self) -> None:
        """Put the cluster file's nodes and layers back (the nodes a failover left out serve
        again): new requests wait, running ones may finish for ``restore_drain_s``, then the
        rest pause and are replayed on the restored pipeline (``Recovery.restore``; when the
        file's layout cannot be had after all, the one that served comes back)."""
        f = self.failover
        assert f is not None and self.file_plan is not None
        if self.serving.state is not ServingState.SERVING:
            return
        self._serve(ServingEvent.RESTORE, "putting the cluster file's layout back")
        restoring = lambda: self.serving.state is ServingState.RESTORING  # noqa: E731
        if not await drained(lambda: self.active, restoring, self._clock, f.restore_drain_s):
            return  # a stage was lost meanwhile: a failover took over
        waiting = self.active
        self._interrupt(PipelineInterrupted("the cluster file's layout is being restored"))
        old, standby = self.chain, self.cluster.standby_nodes()
        await old.close()
        restore = Recovery(self._build, f, self.cluster.pipeline_nodes(), self.file_plan, (),
                           standby, self.file_plan)  # fmt: skip
        back = Recovery(self._build, f, old.nodes(), old.plan, (), standby, self.file_plan)
        new = await restore.restore(waiting, back)
        if new is not None:
            self.install(new.chain)
            return
        self._serve(ServingEvent.GIVE_UP, "the cluster file's layout could not be restored, nor "
                    "the one that served before")  # fmt: skip
        self._tasks["recovery"] = spawn(self._until_back(restore), name="failover-retry")

    async def _until_back(self, recovery: Recovery) -> None:
        self.install(await recovery.until_back())

    def install(self, chain: StageChain) -> None:
        """Serve on a new pipeline (after a recovery, or the lost stage came back)."""
        self.chain = chain
        self.lost_nodes = set()
        self.meter = SpeedMeter(len(chain.links))
        self.router.reset(len(chain.links))
        self._serve(ServingEvent.RECOVER, "all stages connected")
