"""``mlxppd serve``: a stage node, the coordinator node, or a whole local cluster.

Every role runs one asyncio loop for I/O and one mlx thread. A stage node and the coordinator
take their place from the cluster TOML; the local cluster writes such a TOML (and a fresh
secret) itself and starts real stage processes on loopback, so it runs the same code path as a
multi-host cluster.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from mlxppd.core.adapters import parse_adapter_flag
from mlxppd.core.agent.desired import cluster_layer_plan
from mlxppd.core.config.cluster import ClusterConfig, NodeRole, load_cluster_config
from mlxppd.core.config.tls import TlsFiles
from mlxppd.core.cpu_weights import CpuWeights, float32_config
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.fair_share import DEFAULT_MAX_CHOICES_PER_REQUEST
from mlxppd.core.kv_admission import DEFAULT_STAGE_SEQUENCES
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.partition.launch import cluster_partition_plan, launch_warnings
from mlxppd.core.partition.plan import PartitionPlan, plan_layers
from mlxppd.core.partition.quality import quality_report
from mlxppd.core.profile.model import profile_from_config, read_model_config
from mlxppd.core.stages import StageSpec
from mlxppd.engine.embedded import default_cache_dir
from mlxppd.engine.model_files import resolve_model_dir
from mlxppd.engine.tokenizer import load_tokenizer
from mlxppd.runtime.coordinator.coordinator import Coordinator
from mlxppd.runtime.node_start import (
    CoordinatorSetup,
    StageSetup,
    run_tensor_follower,
    start_pipeline_coordinator,
    start_stage_worker,
)
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.timeline import StartTimeline
from mlxppd.runtime.stage.tp_stage import tensor_place
from mlxppd.runtime.system.atomic_write import write_text_atomic
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.node_key import NodeKey, check_own_key, load_node_key
from mlxppd.wire.secret import load_cluster_secret

log = logging.getLogger("mlxppd.serve")


@dataclass(frozen=True)
class NodeOptions:
    """What a node needs beyond the cluster TOML (from flags)."""

    model: str | None
    cluster_file: Path
    node_id: str
    adapters: tuple[str, ...] = ()
    """``--adapter`` values on top of the cluster TOML's adapters"""
    secret_file: str | None = None
    node_key_file: str | None = None
    """--node-key-file; None: MLXPP_NODE_KEY_FILE, then node.key beside the cluster TOML"""
    host: str = "127.0.0.1"
    port: int = 8080
    kv_budget_bytes: int | None = None
    max_sequences: int = DEFAULT_STAGE_SEQUENCES
    parallel: int = 64
    """sequences generated at once (every choice of n counts), shared fairly between clients"""
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST
    """the most choices (n) one request may ask for"""
    warmup: bool = True
    alias: str | None = None
    api_key: str | None = field(default=None, repr=False)
    """the OpenAI API bearer key (--api-key or the content of --api-key-file); never shown"""
    cors_origins: tuple[str, ...] = ()
    """--cors-origin: origins whose web pages may call the HTTP API (http/cors.py)"""
    tls: TlsFiles | None = None
    """--tls-cert/--tls-key: the HTTP listeners serve HTTPS (core/config/tls.py); None: HTTP"""
    ready_file: Path | None = None
    once_prompt: str | None = None
    once_max_tokens: int = 64
    micro_batch_size: int = 0  # 0: auto, one balanced micro-batch per stage
    prompt_cache_entries: int = 8
    """prompt prefixes the stages keep for reuse (0: none)"""
    prefill_chunk_size: int | None = None
    """prompt tokens per prefill pass (None: sized per prompt, core/prefill_chunks.py)"""
    metrics: bool = False
    metrics_port: int | None = None
    metrics_ready_file: Path | None = None
    trace_path: Path | None = None
    log_level: str = "INFO"
    """--log-level, passed on to the stage processes of a local cluster"""
    cpu_weights: CpuWeights | None = None
    """--cpu-weights; None: the cluster TOML's [cluster] cpu_weights"""
    elastic: tuple[tuple[str, Any], ...] = ()
    """the --enable-elastic-pp / --elastic-pp-* flags given, as (policy key, value) pairs"""
    verbose: bool = False
    """--verbose: the coordinator logs the partition quality report once its stages load"""
    timeline: StartTimeline | None = field(default=None, repr=False, compare=False)
    """where the start's moments are marked (the local cluster's, with its stages'); None: a
    new one"""


def stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def load_node_cluster(options: NodeOptions) -> tuple[ClusterConfig, Any, NodeKey]:
    """The cluster TOML, the secret and the node key of a ``--distributed-config`` node."""
    return _load_cluster(options)


def with_adapter_flags(cluster: ClusterConfig, flags: tuple[str, ...]) -> ClusterConfig:
    """The cluster with ``--adapter`` values on top of its TOML: DIR replaces the fused
    adapter, NAME=DIR adds (or replaces) a named one."""
    if not flags:
        return cluster
    data = cluster.model_dump(mode="json")
    named = {a["name"]: a for a in data.get("adapters", [])}
    for flag in flags:
        name, path = parse_adapter_flag(flag)
        where = str(Path(path).expanduser().absolute())
        if name is None:
            data["cluster"]["adapter"] = where
        else:
            named[name] = {"name": name, "path": where}
    data["adapters"] = list(named.values())
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigurationError(str(exc.errors()[0]["msg"]), source="--adapter") from None


def _load_cluster(options: NodeOptions) -> tuple[ClusterConfig, Any, NodeKey]:
    cluster = with_adapter_flags(load_cluster_config(options.cluster_file), options.adapters)
    secret = load_cluster_secret(
        flag_path=options.secret_file,
        config_secret_file=cluster.cluster.secret_file,
        config_dir=options.cluster_file.parent,
    )
    node_key = load_node_key(
        options.node_id, flag_path=options.node_key_file, config_dir=options.cluster_file.parent
    )
    check_own_key(cluster.node_roster, options.node_id, node_key, source=str(options.cluster_file))
    return cluster, secret, node_key


def write_ready(path: Path | None, text: str) -> None:
    if path is not None:
        write_text_atomic(path, text)


async def run_stage_node(options: NodeOptions) -> int:
    cluster, secret, node_key = _load_cluster(options)
    node = cluster.find_node(options.node_id)
    if node is None or node.role is NodeRole.COORDINATOR or node.stage is None:
        raise ConfigurationError(
            f"node '{options.node_id}' is not a pipeline stage in this cluster",
            source=str(options.cluster_file),
            key="--node-id",
        )
    model_dir = resolve_model_dir(options.model)
    config = read_model_config(model_dir)
    ranges = cluster_layer_plan(cluster, config)
    layers = ranges[node.stage]
    setup = StageSetup(
        cluster=cluster,
        node_id=node.id,
        secret=secret,
        node_key=node_key,
        model_dir=model_dir,
        model_config=config,
        spec=StageSpec.holding(node.stage, len(ranges), layers),
        host=node.host,
        port=node.port,
        transport=cluster.cluster.transport_backend,
        kv_budget_bytes=options.kv_budget_bytes or cluster.cluster.kv_budget_bytes,
        max_sequences=options.max_sequences,
        cpu_weights=options.cpu_weights or cluster.cluster.cpu_weights,
        digest_cache=default_cache_dir(),
        tensor=tensor_place(cluster, node),
    )
    mlx = MlxThread(f"mlx-stage{node.stage}")
    if setup.tensor is not None and setup.tensor.rank > 0:
        return await _follow(setup, mlx, options.ready_file)
    try:
        stop = stop_event()
        worker, address = await start_stage_worker(setup, mlx)
        write_ready(options.ready_file, f"{address[0]}:{address[1]}\n")
        ends = [asyncio.ensure_future(e.wait()) for e in (stop, worker.ring_lost)]
        await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        for end in ends:
            end.cancel()
        await worker.close()
        # A lost rank: exit with an error, so whoever runs the stage starts its ranks again.
        return 1 if worker.ring_lost.is_set() else 0
    finally:
        mlx.close()


async def _follow(setup: StageSetup, mlx: MlxThread, ready_file: Path | None) -> int:
    """A tensor-parallel rank above 0: it listens on no transport; it follows rank 0 until
    rank 0 stops, or until this process is told to stop."""
    stop = stop_event()
    assert setup.tensor is not None
    follower = asyncio.ensure_future(run_tensor_follower(setup, mlx))
    write_ready(ready_file, f"{setup.tensor.ring[setup.tensor.rank]}\n")
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait((follower, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if follower.done():
        follower.result()  # a load that failed says why
    # The mlx thread may sit in a collective that only rank 0 could end: do not wait on it.
    mlx.close(timeout=0.5)
    return 0


def partition_warnings(
    cluster: ClusterConfig, model_config: Any, ranges: Sequence[LayerRange]
) -> tuple[str, ...]:
    """The pre-launch warnings of a coordinator's plan (docs/partitioning.md)."""
    plan = cluster_partition_plan(cluster, profile_from_config(model_config), ranges)
    return launch_warnings(plan, cluster.cluster.transport_backend)


def log_partition_warnings(warnings: Sequence[str]) -> None:
    for warning in warnings:
        log.warning("partition warning: %s", warning)


async def log_partition_report(
    coordinator: Coordinator, plan: PartitionPlan, model_config: Any
) -> None:
    """``--verbose``: the report ``generate --verbose`` prints, with each stage's loaded bytes
    when every stage answers its status request (priced as float32 when the stages hold
    float32 weights, as ``generate`` prices what its stages hold)."""
    reports = await coordinator.stage_reports()
    loaded = [reports.get(s.device_id) for s in plan.stages]
    held = [r for r in loaded if r is not None]
    if len(held) < len(loaded):
        log.info("%s", quality_report(plan).format())
        return
    if all(r.weights == "float32" for r in held):
        ids = [s.device_id for s in plan.stages]
        profile = profile_from_config(float32_config(model_config))
        plan = replace(plan_layers(profile, plan.ranges, device_ids=ids), warnings=plan.warnings)
    report = quality_report(plan).with_actual([r.parameter_bytes for r in held])
    log.info("%s", report.format())


async def start_coordinator(options: NodeOptions) -> Coordinator:
    cluster, secret, node_key = _load_cluster(options)
    node = cluster.find_node(options.node_id)
    if node is None or node.role is not NodeRole.COORDINATOR:
        raise ConfigurationError(
            f"node '{options.node_id}' is not the coordinator (role hybrid) of this cluster",
            source=str(options.cluster_file),
            key="--node-id",
        )
    model_dir = resolve_model_dir(options.model)
    model_config = read_model_config(model_dir)
    ranges = cluster_layer_plan(cluster, model_config)
    plan = cluster_partition_plan(cluster, profile_from_config(model_config), ranges)
    log_partition_warnings(launch_warnings(plan, cluster.cluster.transport_backend))
    setup = CoordinatorSetup(
        cluster=cluster,
        node_id=node.id,
        secret=secret,
        node_key=node_key,
        transport=cluster.cluster.transport_backend,
        plan=ranges,
        model_config=model_config,
        model_dir=model_dir,
        digest_cache=default_cache_dir(),
        micro_batch_size=options.micro_batch_size,
        prompt_cache=options.prompt_cache_entries,
        prefill_chunk=options.prefill_chunk_size,
        parallel=options.parallel,
        warmup=options.warmup,
        trace_path=options.trace_path,
        timeline=options.timeline,
    )
    # Always measured: the web console charts them; /metrics serves them only when asked.
    coordinator = await start_pipeline_coordinator(
        setup, load_tokenizer(model_dir), options.alias or model_dir.name,
        PipelineMetrics(CollectorRegistry()),
    )  # fmt: skip
    if options.verbose:
        await log_partition_report(coordinator, plan, model_config)
    return coordinator
