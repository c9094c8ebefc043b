"""Serving the OpenAI API for a node: the coordinator of a cluster, or every stage in-process.

This composes the runtime's backends with the HTTP application; ``--once`` sends one chat
request through that same HTTP API and prints the answer (the demo and a smoke test).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxppd.app.api_app import api_app
from mlxppd.app.http_site import http_url, server_context, start_site
from mlxppd.core.agent.elastic import policy_with
from mlxppd.core.agent.plan import StageAddress
from mlxppd.core.config.cluster import ClusterConfig
from mlxppd.core.config.ports import DEFAULT_TRANSPORT_PORT_RANGE, PortRange, parse_port_range
from mlxppd.core.cpu_weights import CpuWeights, float32_config
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.profile.model import profile_from_config, read_model_config
from mlxppd.engine.families import family_for
from mlxppd.engine.model_files import resolve_model_dir
from mlxppd.http.admin_api import AdminApi, signed_admin_api
from mlxppd.http.base_app import create_metrics_app
from mlxppd.http.console_feed import ConsoleFeed
from mlxppd.runtime.agent.status import CoordinatorAdmin, CoordinatorView
from mlxppd.runtime.backends.contract import GenerationBackend
from mlxppd.runtime.backends.inprocess import InProcessBackend
from mlxppd.runtime.coordinator.elastic_driver import ElasticDriver
from mlxppd.runtime.coordinator.gate import GatedBackend
from mlxppd.runtime.local_cluster import LocalCluster
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.timeline import StartTimeline
from mlxppd.runtime.serve import (
    NodeOptions,
    load_node_cluster,
    partition_warnings,
    start_coordinator,
    stop_event,
    write_ready,
)
from mlxppd.runtime.system import event_loop
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.tasks import spawn, stop_tasks

log = logging.getLogger("mlxppd.serve")


async def serve_http(
    backend: GenerationBackend,
    options: NodeOptions,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    admin: AdminApi | None = None,
    console: ConsoleFeed | None = None,
) -> None:
    metrics: PipelineMetrics | None = getattr(backend, "metrics", None)
    app = api_app(
        backend,
        console,
        api_key=options.api_key,
        alias=options.alias,
        cors_origins=options.cors_origins,
        max_choices_per_request=options.max_choices_per_request,
        max_sequences=options.parallel,
        metrics=metrics,
        metrics_route=options.metrics,
        admin=admin,
    )
    # Loaded here, not kept in the options: a context is no value to copy (checked at start).
    tls = server_context(options.tls) if options.tls is not None else None
    runner, bound = await start_site(app, options.host, options.port, tls=tls)
    url = http_url(options.host, bound, tls=tls is not None)
    log.info("coordinator: OpenAI API on %s/v1", url)
    if console is not None:
        log.info("coordinator: web console on %s/console", url)
        if console.timeline is not None:
            console.timeline.mark(f"HTTP API and console listening on {url}")
    runners = [runner]
    if metrics is not None and options.metrics_port is not None:
        # A separate listener, e.g. bound where only the Prometheus server reaches it.
        metrics_runner, port = await start_site(
            create_metrics_app(metrics), options.host, options.metrics_port, tls=tls
        )
        runners.append(metrics_runner)
        metrics_url = http_url(options.host, port, tls=tls is not None)
        log.info("coordinator: metrics on %s/metrics", metrics_url)
        write_ready(options.metrics_ready_file, metrics_url + "\n")
    try:
        write_ready(options.ready_file, url + "\n")
        if on_ready is not None:
            on_ready(url)
        await (stop or stop_event()).wait()
    finally:
        for r in runners:
            await r.cleanup()


def _one_host(cluster: ClusterConfig) -> bool:
    """Every node on loopback: no other host holds the secret (a local cluster)."""

    def loopback(host: str) -> bool:
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return host == "localhost"

    return all(loopback(node.host) for node in cluster.nodes)


async def run_coordinator_node(options: NodeOptions) -> int:
    """The coordinator of a cluster: the OpenAI API, the admin API (status, drain, resume,
    elastic repartition) and, when enabled, the elastic driver with its pressure watch."""
    cluster, secret, _ = load_node_cluster(options)
    policy = policy_with(cluster.cluster.elastic, dict(options.elastic))
    if options.timeline is None:
        options = replace(options, timeline=StartTimeline())
    coordinator = await start_coordinator(options)
    gate = GatedBackend(coordinator.tokenizer, coordinator.model_id)
    gate.coordinator = coordinator
    assert coordinator.plan is not None
    model_dir = resolve_model_dir(options.model)
    config = read_model_config(model_dir)
    driver = ElasticDriver(
        policy,
        coordinator.plan,
        profile_from_config(config),
        gate,
        metrics=coordinator.metrics,
        float32_profile=profile_from_config(float32_config(config)),
    )
    stages = tuple(StageAddress(n.id, n.host, n.port) for n in cluster.pipeline_nodes())
    http = f"{options.host}:{options.port}"
    scheme = "https" if options.tls is not None else "http"
    warnings = partition_warnings(cluster, config, coordinator.plan)
    view = CoordinatorView(
        cluster_name=lambda: cluster.cluster.name,
        node_id=lambda: options.node_id,
        gate=lambda: gate,
        stages=lambda: stages,
        http_address=lambda: http,
        driver=lambda: driver,
        last_error=lambda: coordinator.health().detail,
        warnings=lambda: warnings,
    )
    controller = CoordinatorAdmin(view)
    admin = signed_admin_api(
        controller, secret.key_bytes(), coordinator.metrics, cluster.cluster.name,
        operators=cluster.operators, warn_legacy=not _one_host(cluster),
    )  # fmt: skip
    console = ConsoleFeed(
        controller, coordinator.metrics, driver.profile, options.timeline,
        float32_profile=driver.float32_profile,
    )  # fmt: skip
    if policy.enabled:
        log.info(
            "elastic repartitioning on: `mlxppctl repartition --url %s://%s "
            "--cluster-secret-file %s`",
            scheme,
            http,
            options.secret_file or "<the cluster secret>",
        )
    stop_watch = asyncio.Event()
    watch = spawn(driver.watch_pressure(stop_watch), name="elastic-pressure")
    try:
        if options.once_prompt is not None:
            await ask_once(gate, options, admin=admin)
            return 0
        await serve_http(gate, options, admin=admin, console=console)
        return 0
    finally:
        stop_watch.set()
        await driver.close()
        await stop_tasks(watch, cancel=False)
        await coordinator.close()


async def ask_once(
    backend: GenerationBackend, options: NodeOptions, admin: AdminApi | None = None
) -> None:
    """Serve HTTP, send one chat request to it, print the answer, stop (the demo / smoke test)."""
    import aiohttp

    stop = asyncio.Event()
    answer: dict[str, Any] = {}

    async def client(url: str) -> None:
        body = {
            "model": options.alias or backend.model_id,
            "messages": [{"role": "user", "content": options.once_prompt}],
            "max_tokens": options.once_max_tokens,
            "temperature": 0,
        }
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        try:
            # The listener this process just started: its certificate needs no verifying.
            connector = aiohttp.TCPConnector(ssl=False)
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response,
            ):
                answer.update(await response.json())
                answer["_status"] = response.status
        finally:
            stop.set()

    tasks: list[asyncio.Task[None]] = []

    def on_ready(url: str) -> None:
        print(f"POST {url}/v1/chat/completions: {options.once_prompt}", file=sys.stderr)
        tasks.append(spawn(client(url), name="once-client"))

    await serve_http(backend, options, on_ready=on_ready, stop=stop, admin=admin)
    await stop_tasks(*tasks, cancel=False)
    if answer.get("_status") != 200:
        raise ConfigurationError(f"the chat request failed: {answer}")
    print(answer["choices"][0]["message"]["content"])


async def run_inprocess(options: NodeOptions, model_dir: Path) -> int:
    """Every stage in this process (no cluster): the same HTTP API over one process."""
    if any(value for _, value in options.elastic):
        raise ConfigurationError(
            "elastic repartitioning moves layers between stage processes; add --pp-size 2 "
            "(or more) or --distributed-config",
            source="--enable-elastic-pp",
        )
    if options.metrics or options.metrics_port is not None or options.trace_path is not None:
        # Stage metrics and traces come from stage workers; say so rather than serve nothing.
        raise ConfigurationError(
            "--metrics, --metrics-port and --debug-pp-trace need a pipeline; "
            "add --pp-size 2 (or more) or --distributed-config",
            source="mlxppd serve",
        )
    config = read_model_config(model_dir)
    ranges = ((0, family_for(config).num_layers(config)),)
    mlx = MlxThread("mlx")
    try:
        backend = InProcessBackend(
            model_dir,
            tuple(LayerRange(a, b) for a, b in ranges),
            mlx,
            options.alias or model_dir.name,
            kv_budget_bytes=options.kv_budget_bytes,
            max_sequences=options.max_sequences,
            cpu_weights=options.cpu_weights or CpuWeights.AUTO,
        )
        await backend.start()
        if options.once_prompt is not None:
            await ask_once(backend, options)
        else:
            await serve_http(backend, options)
        return 0
    finally:
        mlx.close()


def run_local_cluster(
    template: NodeOptions,
    ranges: tuple[LayerRange, ...],
    *,
    port_range: PortRange | None = None,
    transport_backend: str = "tcp",
    tp: int = 1,
    operators: Mapping[str, str] | None = None,
) -> int:
    """Start the stages (``tp`` rank processes each), then the coordinator here; stop
    everything on exit or failure.

    Transport ports come from ``port_range`` (None: the default range), the first free ones;
    ``operators`` (``--operator``) is the cluster TOML's [operators].
    """
    if len(ranges) < 2:
        raise ConfigurationError("a local cluster needs at least 2 stages", source="--pp-size")
    cluster = LocalCluster(
        template.model,
        ranges,
        template.kv_budget_bytes,
        template.max_sequences,
        cpu_weights=str(template.cpu_weights) if template.cpu_weights is not None else None,
        log_level=template.log_level,
        given_secret_file=template.secret_file,
        port_range=port_range or parse_port_range(DEFAULT_TRANSPORT_PORT_RANGE),
        transport_backend=transport_backend,
        tp=tp,
        adapters=template.adapters,
        operators=dict(operators or {}),
    )

    async def coordinate() -> int:
        # Supervision ends inside the loop, so no stage is restarted once stop() begins.
        async with cluster.supervision():
            return await run_coordinator_node(cluster.node_options(template))

    try:
        cluster.start_stages()
        return event_loop.run(coordinate())
    except KeyboardInterrupt:
        return 130
    finally:
        cluster.stop()
