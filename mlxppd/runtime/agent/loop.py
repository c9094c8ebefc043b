"""``mlxppd agent``: read the config directory, reconcile, keep serving, react to changes.

One pass: load the files into a desired state (``core.agent.desired``), ``plan`` against what
runs, carry the actions out (``runtime.agent.actions``). Passes run at start, when the
directory changes (watchfiles), on SIGHUP, and every ``reconcile_interval_s`` (which heals
lost stage links). A configuration that fails to load changes nothing: the node keeps serving,
and the error is logged once, counted, and shown in status until a good one loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxppd.core.agent.desired import config_generation, desired_state, match_node
from mlxppd.core.agent.elastic import policy_with
from mlxppd.core.agent.plan import CoordinatorTarget, DesiredState, plan
from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.config.host import CLUSTER_FILE, HOST_FILE, HostSettings, load_host_settings
from mlxppd.core.config.private_file import allow_loose_from
from mlxppd.core.errors import ConfigurationError, MlxppError
from mlxppd.core.protocol.control import StageExtras, clip
from mlxppd.core.stages import StageSpec
from mlxppd.engine.embedded import default_cache_dir
from mlxppd.engine.prepared_copy import stage_model_dir
from mlxppd.engine.tokenizer import load_tokenizer
from mlxppd.runtime.agent.actions import AgentContext, NodeRuntime
from mlxppd.runtime.agent.model_place import ModelPlace, locate_model
from mlxppd.runtime.coordinator.gate import GatedBackend
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.runtime.system.sd_notify import SdNotifier, watchdog_loop
from mlxppd.runtime.system.service_logging import configure_logging
from mlxppd.wire.node_key import check_own_key, load_node_key
from mlxppd.wire.secret import load_cluster_secret
from mlxppd.wire.tasks import race, spawn, stop_tasks

log = logging.getLogger("mlxppd.agent")

HttpStarter = Callable[[GatedBackend, CoordinatorTarget, "Agent"], Awaitable[Any]]


def load_configuration(
    config_dir: Path,
    overrides: Mapping[str, Any],
    environ: Mapping[str, str],
    is_local: Callable[[str], bool],
    *,
    model_dir: Path | None = None,
    elastic: Mapping[str, Any] | None = None,
) -> tuple[DesiredState, AgentContext]:
    """Every file of the config directory, checked and turned into a desired state.

    ``model_dir``: the configured model directory already resolved (a running agent cannot
    switch models; the embedded one is converted once)."""
    host = load_host_settings(config_dir, environ=environ, overrides=overrides)
    path = config_dir / CLUSTER_FILE
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the cluster TOML: {exc.strerror or exc}; every host needs the same "
            f"{CLUSTER_FILE} in its config directory (--config-dir or MLXPP_CONFIG_DIR, "
            "default /etc/mlxpp)",
            source=str(path),
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigurationError("the cluster TOML is not UTF-8 text", source=str(path)) from None
    cluster = parse_cluster_config(text, str(path))
    policy = policy_with(cluster.cluster.elastic, elastic or {})
    if policy != cluster.cluster.elastic:
        # --enable-elastic-pp and --elastic-pp-* win over [cluster.elastic].
        section = cluster.cluster.model_copy(update={"elastic": policy})
        cluster = cluster.model_copy(update={"cluster": section})
    secret = load_cluster_secret(
        flag_path=overrides.get("secret_file"),
        environ=environ,
        config_secret_file=host.secret_file or cluster.cluster.secret_file,
        config_dir=config_dir,
    )
    node = match_node(cluster, host.node_id, is_local)
    node_key = load_node_key(
        node.id,
        flag_path=overrides.get("node_key_file"),
        environ=environ,
        config_value=host.node_key_file,
        config_dir=config_dir,
    )
    check_own_key(cluster.node_roster, node.id, node_key, source=str(path))
    # A configured state_dir holds the model cache, unless MLXPP_MODEL_CACHE says otherwise.
    cache = default_cache_dir()
    if "state_dir" in host.model_fields_set and not environ.get("MLXPP_MODEL_CACHE"):
        cache = Path(host.state_dir) / "models"
    place = locate_model(host.model, cache, known=model_dir)
    desired = desired_state(
        cluster,
        host,
        node,
        place.config,
        config_generation(raw),
        allow_loose=allow_loose_from(environ),
    )
    desired = _with_model_files(desired, place)
    source = place.source or place.configured or place.root
    context = AgentContext(
        cluster, host, secret, source, place.config or {}, place, node_key=node_key
    )
    return desired, context


def _with_model_files(desired: DesiredState, place: ModelPlace) -> DesiredState:
    """The stage target with the directory its tensors come from: the prepared copy when it
    covers the stage (and still verifies: a tampered one is refused here, never loaded)."""
    target = desired.stage
    if target is None or target.awaiting_model or place.config is None:
        return desired
    files = place.configured
    if target.layers is not None:
        spec = StageSpec.holding(target.stage, target.num_stages, target.layers)
        files = stage_model_dir(place.configured, place.root, spec, place.config, place.cache_dir)
    return replace(desired, stage=replace(target, model_files=str(files or "")))


def _role(desired: DesiredState) -> str:
    """The node's role for its journal fields: coordinator, pipeline_stage or standby."""
    if desired.coordinator is not None:
        return "coordinator"
    return "standby" if desired.stage is not None and desired.stage.standby else "pipeline_stage"


def _standby_line(spec: StageSpec | None) -> str:
    """A standby's state: holding nothing, or serving the lost stage the coordinator gave it."""
    if spec is None or spec.is_standby:
        return "standby holding no layers"
    return f"standby serving stage {spec.index}'s layers {spec.start}-{spec.end - 1} (adopted)"


class Agent:
    def __init__(
        self,
        config_dir: Path,
        overrides: Mapping[str, Any],
        environ: Mapping[str, str],
        *,
        is_local: Callable[[str], bool],
        notifier: SdNotifier,
        http_starter: HttpStarter,
        metrics: PipelineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        elastic: Mapping[str, Any] | None = None,
    ) -> None:
        self.config_dir = config_dir
        self._elastic = dict(elastic or {})
        self._overrides = dict(overrides)
        self._environ = environ
        self._is_local = is_local
        self.notifier = notifier
        self.metrics = metrics
        self._clock = clock
        self.mlx = MlxThread("mlx-agent")
        self.runtime = NodeRuntime(
            self.mlx,
            tokenizer_loader=load_tokenizer,
            stage_extras=self.stage_extras,
            start_http=lambda backend, target: http_starter(backend, target, self),
            metrics=metrics,
            on_model_installed=self.trigger,
        )
        self.desired: DesiredState | None = None
        self.context: AgentContext | None = None
        self.last_reload_error: str | None = None
        self.last_reconcile_error: str | None = None
        self.reload_failures = 0
        self.passes = 0
        self._changed = asyncio.Event()
        self._ready_sent = False
        # systemd waits for READY=1 after RELOADING=1, whatever the reload's outcome.
        self._reload_pending = False
        self._log_level = ""
        self._last_status = ""

    # -- what other parts read -----------------------------------------------------------------

    @property
    def host(self) -> HostSettings:
        assert self.context is not None
        return self.context.host

    def stage_extras(self) -> StageExtras:
        """Added to this node's stage status reports (the coordinator shows them)."""
        return StageExtras(
            node_id=clip(self.desired.node_id, 128) if self.desired else None,
            config_generation=self.runtime.generation,
            last_reload_error=clip(self.last_reload_error or self.last_reconcile_error),
            reload_failures=self.reload_failures,
            memory_budget_bytes=self.context.host.memory_budget_bytes if self.context else None,
            last_reload=self.runtime.last_reload,
        )

    def _secret_name(self) -> str:
        """The secret file's name when it is configured by path (a change reloads it)."""
        if self.context is None:
            return ""
        configured = self.context.host.secret_file or self.context.cluster.cluster.secret_file
        return Path(configured).name if configured else ""

    def serving(self) -> bool:
        rt = self.runtime
        if rt.stage is not None:
            if rt.follower is not None:
                return rt.follower.following and rt.follower.running
            return rt.worker is not None
        if rt.coordinator is not None:
            return rt.http is not None and rt.observed().pipeline_connected
        return False

    def trigger(self) -> None:
        """Reload the files and reconcile now (SIGHUP, a file change, a test)."""
        self._changed.set()

    # -- loading ---------------------------------------------------------------------------------

    def load(self) -> None:
        """Load the directory; on failure keep the previous desired state and record why."""
        model_dir = self.context.place.configured if self.context is not None else None
        try:
            desired, context = load_configuration(
                self.config_dir, self._overrides, self._environ, self._is_local,
                model_dir=model_dir, elastic=self._elastic,
            )  # fmt: skip
            if self.context is not None and context.host.model != self.context.host.model:
                raise ConfigurationError(
                    "the model cannot change while mlxppd runs; restart the service to "
                    "switch models",
                    source=str(self.config_dir / "mlxppd.toml"),
                    key="model",
                )
        except MlxppError as exc:
            if self.desired is None:
                raise  # nothing serves yet: a start-up error
            self.reload_failures += 1
            self.last_reload_error = str(exc)
            if self.metrics is not None:
                self.metrics.config_reload_failures.inc()
            log.error("config reload failed, still serving the previous configuration: %s", exc)
            return
        self.last_reload_error = None
        previous = self.desired
        self.desired, self.context = desired, context
        role = _role(desired)
        wanted = (desired.node_id, context.host.log_level)
        if previous is None or (previous.node_id, self._log_level) != wanted:
            # Journal fields carry the node id and role once they are known.
            configure_logging(
                context.host.log_level, environ=self._environ, node_id=desired.node_id, role=role
            )
            self._log_level = context.host.log_level

    async def reconcile(self) -> None:
        assert self.desired is not None and self.context is not None
        actions = plan(self.desired, self.runtime.observed())
        self.passes += 1
        if not actions:
            self._notify_state()
            return
        try:
            await self.runtime.apply(actions, self.context)
            self.last_reconcile_error = None
        except MlxppError as exc:
            self.last_reconcile_error = str(exc)
            log.error("reconcile: %s; retrying in %.0f s", exc, self.host.reconcile_interval_s)
        except (OSError, TimeoutError) as exc:
            self.last_reconcile_error = f"{type(exc).__name__}: {exc}"
            log.error("reconcile: %s; retrying in %.0f s", exc, self.host.reconcile_interval_s)
        self._notify_state()

    def _notify_state(self) -> None:
        status = self.describe()
        if self.last_reload_error:
            status = f"config reload failed, serving the previous one: {self.last_reload_error}"
        if self._reload_pending and self._ready_sent:
            self._reload_pending = False
            self.notifier.ready(status)
        elif self.serving() and not self._ready_sent:
            self._ready_sent = True
            self.notifier.ready(status)
        elif status != self._last_status:
            self.notifier.status(status)
        self._last_status = status

    def describe(self) -> str:
        """One line for STATUS= and logs."""
        rt = self.runtime
        generation = rt.generation or "-"
        if self.last_reconcile_error:
            return f"not converged (generation {generation}): {self.last_reconcile_error}"
        if rt.stage is not None and rt.stage.awaiting_model:
            return (
                f"holding no copy of the model yet (mlxppctl prepare ships it), config {generation}"
            )
        if rt.stage is not None and rt.stage.standby:
            return f"{_standby_line(rt.held_spec())}, config {generation}"
        if rt.stage is not None and rt.stage.layers is not None:
            r = rt.stage.layers
            rank = f" rank {rt.stage.tp_rank}" if rt.stage.tensor else ""
            doing = "following rank 0 on" if rt.stage.tp_rank else "serving"
            return (
                f"stage {rt.stage.stage}{rank} {doing} layers {r.start}-{r.last}, "
                f"config {generation}"
            )
        if rt.coordinator is not None:
            stages = len(rt.coordinator.stages)
            where = f"{rt.coordinator.http_host}:{rt.coordinator.http_port}"
            return f"coordinator of {stages} stages on http://{where}, config {generation}"
        return "starting"

    # -- the loop --------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set; then drain and return 0."""
        self.load()  # a start-up error propagates: nothing is running yet
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        tasks = [
            spawn(self._watch(stop), name="agent-watch-config"),
            spawn(watchdog_loop(self.notifier, stop), name="agent-watchdog"),
        ]
        try:
            while not stop.is_set():
                # A stop (SIGTERM) during a long reconcile (a slow connect) cancels it.
                await race(self.reconcile(), stop.wait())
                if stop.is_set():
                    break
                await race(
                    self._changed.wait(), stop.wait(), timeout=self.host.reconcile_interval_s
                )
                if self._changed.is_set() and not stop.is_set():
                    self._changed.clear()
                    self.load()
            await self.shutdown()
            return 0
        finally:
            await stop_tasks(*tasks, ignore_errors=True)
            self.mlx.close()

    async def shutdown(self) -> None:
        timeout = self.host.drain_timeout_s
        self.notifier.stopping(f"draining: in-flight requests have up to {timeout:.0f} s")
        log.info("agent: stopping; draining for up to %.0f s", timeout)
        backend = self.runtime.backend
        if backend is not None:
            backend.hold("shutdown", "this node is shutting down; retry on another")
            if not await backend.wait_idle(timeout):
                log.warning("agent: %d requests still running at the timeout", backend.in_flight)
        await self.runtime.close(timeout)

    def _on_sighup(self) -> None:
        log.info("agent: SIGHUP; reloading %s", self.config_dir)
        self.notifier.reloading("reloading the configuration")
        self._reload_pending = True
        self.trigger()

    async def _watch(self, stop: asyncio.Event) -> None:
        import watchfiles

        def relevant(_change: object, path: str) -> bool:
            # Only the files the agent reads: logs or sockets in the directory must not loop.
            name = Path(path).name
            return name in (CLUSTER_FILE, HOST_FILE) or name == self._secret_name()

        while not stop.is_set():
            try:
                async for _ in watchfiles.awatch(
                    self.config_dir, stop_event=stop, debounce=400, watch_filter=relevant
                ):
                    log.info("agent: %s changed; reloading", self.config_dir)
                    self.trigger()
            except (FileNotFoundError, RuntimeError) as exc:
                # The directory may be replaced as a whole (e.g. a config-management tool).
                log.warning("agent: watching %s failed (%s); retrying", self.config_dir, exc)
                await race(stop.wait(), timeout=2.0)
