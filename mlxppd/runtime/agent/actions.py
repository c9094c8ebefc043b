"""Carrying out the agent's actions: the one place that starts, reloads and stops things.

``core.agent.plan.plan`` decides; ``NodeRuntime.apply`` does, action by action, and keeps the
observed state true to what runs. A failed action stops the rest of its plan; what ran before it
stays, and the next reconcile pass plans again from what is observed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlxppd.core.agent.plan import (
    Action,
    Advertise,
    CoordinatorTarget,
    ObservedState,
    RebindStage,
    ReloadStage,
    ReplanCoordinator,
    RestartCoordinator,
    SetGeneration,
    StageTarget,
    StartCoordinator,
    StartStage,
    StopAdvertising,
    StopCoordinator,
    StopStage,
    UpdateKvBudget,
    UpdatePolicy,
    UpdateRoster,
    describe,
)
from mlxppd.core.config.cluster import ClusterConfig, ElasticPolicy
from mlxppd.core.config.host import HostSettings
from mlxppd.core.cpu_weights import float32_config
from mlxppd.core.errors import TemporaryError
from mlxppd.core.kv_admission import UNLIMITED_BYTES
from mlxppd.core.model_identity import IdentityCheck
from mlxppd.core.partition.launch import cluster_partition_plan, launch_warnings
from mlxppd.core.profile.model import ModelConfig, profile_from_config
from mlxppd.core.protocol.control import ReloadReport, StageExtras
from mlxppd.core.stages import StageSpec
from mlxppd.engine.cpu_weights import available_memory_bytes
from mlxppd.engine.prepared_copy import ModelReceiver
from mlxppd.runtime.agent.advertising import NodeAdvert
from mlxppd.runtime.agent.model_place import ModelPlace
from mlxppd.runtime.agent.prepare_job import PrepareJob, Preparer
from mlxppd.runtime.agent.tensor_follower import FollowerRun
from mlxppd.runtime.coordinator.coordinator import Coordinator
from mlxppd.runtime.coordinator.elastic_driver import ElasticDriver
from mlxppd.runtime.coordinator.gate import GatedBackend
from mlxppd.runtime.coordinator.identity_check import ModelMismatch
from mlxppd.runtime.node_start import (
    CoordinatorSetup,
    StageSetup,
    start_pipeline_coordinator,
    start_stage_worker,
)
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.timeline import StartTimeline
from mlxppd.runtime.stage.loader import (
    AdapterPaths,
    load_stage_runner,
    stage_kv_manager,
)
from mlxppd.runtime.stage.tp_stage import TensorPlace
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport, wire_config_for
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.secret import ClusterSecret
from mlxppd.wire.tasks import spawn, stop_tasks

log = logging.getLogger("mlxppd.agent")


@dataclass(frozen=True)
class AgentContext:
    """What actions need besides their targets: the last configuration that loaded."""

    cluster: ClusterConfig
    host: HostSettings
    secret: ClusterSecret
    model_dir: Path
    """the coordinator's tokenizer and the cluster's copy of the model"""
    model_config: ModelConfig
    """config.json ({} while this host holds no copy)"""
    place: ModelPlace
    node_key: NodeKey
    """this node's own key (``[roster]`` lists its public half)"""


def _call_in(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    loop.call_soon_threadsafe(callback)


def _spec(target: StageTarget) -> StageSpec:
    if target.layers is None:  # a standby: no layers until the coordinator gives it a stage's
        return StageSpec.standby(target.num_stages)
    return StageSpec.holding(target.stage, target.num_stages, target.layers)


class NodeRuntime:
    """What this node runs: a stage worker (a standby's holds no layers until the coordinator
    gives it a lost stage's), or the coordinator with its HTTP API."""

    def __init__(
        self,
        mlx: MlxThread,
        *,
        tokenizer_loader: Callable[[Path], Any],
        stage_extras: Callable[[], StageExtras],
        start_http: Callable[[GatedBackend, CoordinatorTarget], Any],
        metrics: PipelineMetrics | None = None,
        connect_timeout_s: float = 60.0,
        on_model_installed: Callable[[], None] = lambda: None,
    ) -> None:
        self.mlx = mlx
        # A prepared copy arrived on this node's stage: reload the files and reconcile.
        self._on_model_installed = on_model_installed
        self.preparer = Preparer(on_done=on_model_installed)
        #: the coordinator's last check of every stage's model identity (status shows it)
        self.identity_checks: list[IdentityCheck] = []
        self._tokenizer_loader = tokenizer_loader
        self._stage_extras = stage_extras
        self._start_http = start_http
        self.metrics = metrics
        self.connect_timeout_s = connect_timeout_s
        self.worker: StageWorker | None = None
        #: a tensor-parallel rank above 0 runs this instead of a worker
        self.follower: FollowerRun | None = None
        self.backend: GatedBackend | None = None
        self.http: Any = None  # an object with ``async close()`` (the HTTP site)
        self.stage: StageTarget | None = None
        self.coordinator: CoordinatorTarget | None = None
        #: the coordinator's start as it happened (the web console shows it)
        self.timeline = StartTimeline()
        self.policy: ElasticPolicy | None = None
        self.generation: str | None = None
        #: timings and tensor counts of the last stage reload (status and tests read them)
        self.last_reload: ReloadReport | None = None
        self.driver: ElasticDriver | None = None
        #: the pre-launch warnings of the coordinator's plan (``mlxppctl status`` shows them)
        self.partition_warnings: tuple[str, ...] = ()
        self._driver_stop = asyncio.Event()
        self._pressure: asyncio.Task[None] | None = None
        #: the node keys every transport of this node believes (UpdateRoster replaces them)
        self.roster: RosterBook | None = None
        #: this node's DNS-SD advertisement (runtime/agent/advertising.py)
        self.advert = NodeAdvert(available_memory_bytes)

    def held_spec(self) -> StageSpec | None:
        """The layers the stage worker holds now: the TOML's, or for a standby the ones the
        coordinator gave it (``is_standby`` while it holds none); None without a worker."""
        return self.worker.spec if self.worker is not None else None

    def observed(self) -> ObservedState:
        connected = True
        if self.coordinator is not None:
            live = self.backend.coordinator if self.backend is not None else None
            connected = live is not None and live.connected
        stage = self.stage
        if self.follower is not None and not self.follower.running:
            stage = None  # rank 0 stopped: start again, to join its ring when it is back
        return ObservedState(
            generation=self.generation,
            policy=self.policy,
            roster=self.roster.current if self.roster is not None else None,
            stage=stage,
            ring_lost=self.worker is not None and self.worker.ring_lost.is_set(),
            coordinator=self.coordinator,
            pipeline_connected=connected,
            advert=self.advert.target,
        )

    async def apply(self, actions: Sequence[Action], ctx: AgentContext) -> None:
        for action in actions:
            log.info("agent: %s", describe(action))
            await self._apply(action, ctx)

    async def _apply(self, action: Action, ctx: AgentContext) -> None:
        if isinstance(action, StartStage):
            await self._start_stage(action.target, ctx)
        elif isinstance(action, StopStage):
            await self._stop_stage(ctx.host.drain_timeout_s)
        elif isinstance(action, ReloadStage):
            await self._reload_stage(action.target, ctx)
        elif isinstance(action, RebindStage):
            await self._rebind_stage(action.target, ctx)
        elif isinstance(action, UpdateKvBudget):
            assert self.worker is not None and self.stage is not None
            self.worker.kv.budget_bytes = action.target.kv_budget_bytes or UNLIMITED_BYTES
            self.worker.kv.max_sequences = action.target.max_sequences
            self.stage = replace(
                self.stage,
                kv_budget_bytes=action.target.kv_budget_bytes,
                max_sequences=action.target.max_sequences,
            )
        elif isinstance(action, StartCoordinator):
            await self._start_coordinator(action.target, ctx)
        elif isinstance(action, StopCoordinator):
            await self._stop_coordinator(ctx.host.drain_timeout_s)
        elif isinstance(action, RestartCoordinator):
            await self._restart_coordinator(action.target, ctx)
        elif isinstance(action, ReplanCoordinator):
            await self._replan_coordinator(action.target, ctx)
        elif isinstance(action, UpdatePolicy):
            self.policy = action.policy
            if self.driver is not None:
                self.driver.update_policy(action.policy)
        elif isinstance(action, UpdateRoster):
            if self.roster is None:
                self.roster = RosterBook(action.roster)
            else:
                self.roster.update(action.roster)  # a removed node's links close now
        elif isinstance(action, Advertise):
            await self.advert.advertise(action.target, ctx.secret.key_bytes())
        elif isinstance(action, StopAdvertising):
            await self.advert.stop()
        elif isinstance(action, SetGeneration):
            self.generation = action.generation

    # -- stage ---------------------------------------------------------------------------------

    async def _start_stage(self, target: StageTarget, ctx: AgentContext) -> None:
        place = ctx.place
        loop = asyncio.get_running_loop()
        receiver = ModelReceiver(
            place.root,
            place.configured,
            place.cache_dir,
            # commit runs in a worker thread; the agent reloads on its own loop
            on_installed=lambda _identity: _call_in(loop, self._on_model_installed),
        )
        missing = None
        if target.awaiting_model:
            where = place.configured or place.root
            missing = f"no model files at {where}"
        setup = StageSetup(
            cluster=ctx.cluster,
            node_id=target.node_id,
            secret=ctx.secret,
            node_key=ctx.node_key,
            roster=self.roster,
            model_dir=Path(target.model_files) if target.model_files else ctx.model_dir,
            model_config=ctx.model_config,
            spec=_spec(target),
            host=target.host,
            port=target.port,
            transport=target.transport,
            kv_budget_bytes=target.kv_budget_bytes,
            max_sequences=target.max_sequences,
            cpu_weights=target.cpu_weights,
            digest_cache=place.cache_dir,
            receiver=receiver,
            missing_model=missing,
            tensor=TensorPlace(target.tp_rank, target.tp_ring, target.tp_nodes, target.tp_addresses)
            if target.tensor
            else None,
        )
        if self.follower is not None:
            await self.follower.stop(0)
        if target.tp_rank > 0:
            self.follower = FollowerRun(setup)
        else:
            self.worker, _ = await start_stage_worker(setup, self.mlx, extras=self._stage_extras)
        self.stage = target

    async def _stop_stage(self, drain_timeout_s: float) -> None:
        if self.follower is not None:
            await self.follower.stop(drain_timeout_s)
            self.follower, self.stage = None, None
        if self.worker is None:
            return
        if not await self.worker.drain(drain_timeout_s):
            log.warning("stage: sequences still running after %.0f s; closing", drain_timeout_s)
        await self.worker.close()
        self.worker, self.stage = None, None

    async def _reload_stage(self, target: StageTarget, ctx: AgentContext) -> None:
        """Drain this stage, load the new layers, swap them in, resume. On any failure the
        old layers keep serving."""
        assert self.worker is not None and self.stage is not None
        assert target.layers is not None  # plan() never reloads a standby: it restarts it
        worker = self.worker
        started = time.monotonic()
        if not await worker.drain(ctx.host.drain_timeout_s):
            worker.resume()
            raise TemporaryError(
                f"sequences did not finish within {ctx.host.drain_timeout_s:.0f} s "
                "(drain_timeout_s); the old layers keep serving and the reload is retried"
            )
        drained = time.monotonic()
        try:
            spec = _spec(target)
            runner, per_token = await load_stage_runner(
                self.mlx,
                Path(target.model_files) if target.model_files else ctx.model_dir,
                spec,
                ctx.model_config,
                reuse=worker.runner,
                weights=target.cpu_weights,
                digest_cache=ctx.place.cache_dir,
                adapters=AdapterPaths.of(ctx.cluster),
            )
            kv = stage_kv_manager(spec, per_token, target.kv_budget_bytes, target.max_sequences)
            loaded = time.monotonic()
            await worker.swap(spec, runner, kv)
        finally:
            worker.resume()
        self.stage = replace(
            self.stage,
            stage=target.stage,
            num_stages=target.num_stages,
            layers=target.layers,
            kv_budget_bytes=target.kv_budget_bytes,
            cpu_weights=target.cpu_weights,
        )
        self.last_reload = ReloadReport(
            layers=f"{target.layers.start}-{target.layers.last}",
            drain_s=drained - started,
            load_s=loaded - drained,
            total_s=time.monotonic() - started,
            loaded_tensors=runner.stage.loaded_tensors,
            reused_tensors=runner.stage.reused_tensors,
        )
        log.info(
            "stage %d (%s) now serves layers %d-%d (drain %.2f s, load %.2f s)",
            spec.index, target.node_id, spec.start, spec.end - 1,
            drained - started, loaded - drained,
        )  # fmt: skip

    async def _rebind_stage(self, target: StageTarget, ctx: AgentContext) -> None:
        assert self.worker is not None and self.stage is not None
        transport = create_transport(
            target.transport,
            wire_config_for(ctx.cluster, target.node_id, ctx.secret, ctx.node_key, self.roster),
        )
        await self.worker.rebind(transport, target.host, target.port)
        self.stage = replace(
            self.stage, host=target.host, port=target.port, transport=target.transport
        )

    # -- coordinator ---------------------------------------------------------------------------

    async def _start_coordinator(self, target: CoordinatorTarget, ctx: AgentContext) -> None:
        profile = profile_from_config(ctx.model_config)
        plan = cluster_partition_plan(ctx.cluster, profile, target.layers)
        self.partition_warnings = launch_warnings(plan, target.transport)
        for warning in self.partition_warnings:
            log.warning("partition warning: %s", warning)
        if self.backend is None:
            tokenizer = self._tokenizer_loader(ctx.model_dir)
            self.backend = GatedBackend(tokenizer, ctx.model_dir.name)
            self.driver = ElasticDriver(
                self.policy or ctx.cluster.cluster.elastic,
                target.layers,
                profile_from_config(ctx.model_config),
                self.backend,
                metrics=self.metrics,
                float32_profile=profile_from_config(float32_config(ctx.model_config)),
            )
            self._driver_stop = asyncio.Event()
            self._pressure = spawn(
                self.driver.watch_pressure(self._driver_stop), name="elastic-pressure"
            )
        # HTTP first: health and the admin API answer while the pipeline connects.
        self.http = await self._start_http(self.backend, target)
        self.coordinator = target
        await self._connect_pipeline(target, ctx)

    async def _connect_pipeline(self, target: CoordinatorTarget, ctx: AgentContext) -> None:
        assert self.backend is not None
        setup = CoordinatorSetup(
            cluster=ctx.cluster,
            node_id=target.node_id,
            secret=ctx.secret,
            node_key=ctx.node_key,
            roster=self.roster,
            transport=target.transport,
            plan=target.layers,
            micro_batch_size=target.micro_batch_size,
            prompt_cache=target.prompt_cache_entries,
            prefill_chunk=target.prefill_chunk_size or None,
            parallel=target.parallel,
            warmup=ctx.host.warmup,
            connect_timeout_s=self.connect_timeout_s,
            model_config=ctx.model_config,
            model_dir=ctx.model_dir,
            digest_cache=ctx.place.cache_dir,
            timeline=self.timeline,
        )
        try:
            coordinator = await start_pipeline_coordinator(
                setup, self.backend.tokenizer, self.backend.model_id, self.metrics
            )
        except ModelMismatch as exc:
            self.identity_checks, self.backend.refusal = exc.checks, str(exc)
            missing = {c.node for c in exc.checks if c.state == "missing"}
            if missing and ctx.cluster.cluster.auto_prepare and self.preparer.may_auto():
                self.start_prepare(ctx, nodes=missing, reason="auto: nodes hold no copy")
            raise
        self.backend.coordinator, self.backend.refusal = coordinator, None
        self.identity_checks = coordinator.identity_checks

    def start_prepare(
        self,
        ctx: AgentContext,
        *,
        nodes: set[str] | None = None,
        max_rate_bytes_s: float | None = None,
        reason: str = "operator",
    ) -> dict[str, Any]:
        """Ship stage nodes (``nodes``, None: all) what their layers need from this host's
        copy, in the background (``mlxppctl prepare``; at start for nodes holding none)."""
        target = self.coordinator
        if target is None:
            return {"accepted": False, "reason": "not_coordinator", "message": "not running"}
        # Rank 0 of each stage (a tensor-parallel stage's other ranks take no shipments).
        stage_nodes = ctx.cluster.pipeline_nodes()
        n = len(target.layers)
        targets = [
            (node, StageSpec.holding(i, n, r))
            for i, (node, r) in enumerate(zip(stage_nodes, target.layers, strict=True))
            if nodes is None or node.id in nodes
        ]
        transport = create_transport(
            target.transport,
            wire_config_for(ctx.cluster, target.node_id, ctx.secret, ctx.node_key, self.roster),
        )
        job = PrepareJob(
            targets, ctx.model_dir, dict(ctx.model_config), transport,
            cache_dir=ctx.place.cache_dir, max_rate_bytes_s=max_rate_bytes_s, reason=reason,
        )  # fmt: skip
        return self.preparer.start(job)

    async def _close_pipeline(self) -> None:
        if self.backend is not None and self.backend.coordinator is not None:
            coordinator, self.backend.coordinator = self.backend.coordinator, None
            await coordinator.close()

    async def _stop_coordinator(self, drain_timeout_s: float) -> None:
        if self.backend is not None:
            self.backend.hold("stop", "this node is shutting down its coordinator")
            await self.backend.wait_idle(drain_timeout_s)
        self._driver_stop.set()
        if self.driver is not None:
            await self.driver.close()
        await stop_tasks(self._pressure, cancel=False)
        await self._close_pipeline()
        if self.http is not None:
            await self.http.close()
        self.http, self.backend, self.coordinator = None, None, None
        self.driver, self._pressure = None, None

    async def _restart_coordinator(self, target: CoordinatorTarget, ctx: AgentContext) -> None:
        assert self.backend is not None and self.coordinator is not None
        backend = self.backend
        backend.hold("restart", "the pipeline is reconnecting; retry after Retry-After seconds")
        try:
            live = backend.coordinator
            if live is not None and live.connected:
                await backend.wait_idle(ctx.host.drain_timeout_s)
            await self._close_pipeline()
            if target.http_key() != self.coordinator.http_key():
                await self.http.close()
                self.http = await self._start_http(backend, target)
            self.coordinator = target
            await self._connect_pipeline(target, ctx)
        finally:
            backend.release("restart")

    async def _replan_coordinator(self, target: CoordinatorTarget, ctx: AgentContext) -> None:
        """New layer ranges: hold admissions, let running requests finish, expect the new
        plan, wait until every stage reports it, then admit again."""
        assert self.backend is not None
        backend = self.backend
        backend.hold("replan", "the cluster is moving layers between stages; retry shortly")
        try:
            if not await backend.wait_idle(ctx.host.drain_timeout_s):
                log.warning("replan: requests still running after the drain timeout")
            live = backend.coordinator
            assert live is not None
            live.expect_plan(target.layers)
            self.coordinator = target
            if self.driver is not None:
                self.driver.reset_ranges(target.layers)
            await self._wait_for_stage_layers(live, target, ctx.host.drain_timeout_s + 60.0)
            # Each stage reloaded from its own files: check what it serves now.
            await live.verify_chain()
            self.identity_checks = live.identity_checks
        finally:
            backend.release("replan")

    async def _wait_for_stage_layers(
        self, live: Coordinator, target: CoordinatorTarget, timeout_s: float
    ) -> None:
        pairs = zip(target.stages, target.layers, strict=True)
        want = {s.node_id: r.pair for s, r in pairs}
        deadline = time.monotonic() + timeout_s
        while True:
            reports = await live.stage_reports()
            have = {n: r.layers if r is not None else None for n, r in reports.items()}
            behind = [n for n, layers in want.items() if have.get(n) != layers]
            if not behind:
                return
            if time.monotonic() >= deadline or not live.connected:
                raise TemporaryError(
                    f"stages {', '.join(behind)} did not report their new layers within "
                    f"{timeout_s:.0f} s; requests are refused until they do"
                )
            await asyncio.sleep(0.2)

    async def close(self, drain_timeout_s: float) -> None:
        """Drain and stop whatever runs (shutdown)."""
        await self.preparer.close()
        with contextlib.suppress(Exception):
            await self.advert.stop()  # gone from the link before it stops answering
        with contextlib.suppress(Exception):
            await self._stop_coordinator(drain_timeout_s)
        with contextlib.suppress(Exception):
            await self._stop_stage(drain_timeout_s)
