"""Starting a node's parts: the one function that starts a stage worker and the one that
connects a coordinator to its stages.

Every path goes through them: ``mlxppd serve --distributed-config`` (and so the local
cluster's stage processes and a zero-config peer once assigned) and the agent's
``NodeRuntime``. What differs between those paths is where the settings come from, never how a
stage or a coordinator is put together.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxppd.core.config.cluster import ClusterConfig
from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.protocol.control import StageExtras
from mlxppd.core.stages import StageSpec
from mlxppd.engine.grammar_compiles import GrammarCompiles
from mlxppd.engine.prepared_copy import ModelReceiver
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.engine.tokenizer import load_tokenizer
from mlxppd.engine.tp_mirror import Announce
from mlxppd.runtime.coordinator.coordinator import Coordinator
from mlxppd.runtime.coordinator.identity_check import IdentityReference
from mlxppd.runtime.coordinator.recovery import FailoverSettings, survivors_replan
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.timeline import StartTimeline
from mlxppd.runtime.stage.loader import (
    AdapterPaths,
    layer_preparer,
    load_stage_runner,
    stage_kv_manager,
)
from mlxppd.runtime.stage.tp_links import (
    FollowerLinks,
    FollowerTrace,
    RankZeroInbox,
    follow_rank_zero,
)
from mlxppd.runtime.stage.tp_stage import TensorPlace, TensorStage, load_tp_stage
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.runtime.system.open_files import raise_open_file_limit
from mlxppd.wire.backends import create_transport, wire_config_for
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.secret import ClusterSecret

log = logging.getLogger("mlxppd.node")


@dataclass(frozen=True)
class StageSetup:
    """Everything a stage worker is built from."""

    cluster: ClusterConfig
    node_id: str
    secret: ClusterSecret
    node_key: NodeKey
    """this node's own key (the roster lists its public half)"""
    model_dir: Path
    model_config: dict[str, Any]
    spec: StageSpec
    host: str
    port: int
    transport: str
    kv_budget_bytes: int | None
    """None: unlimited"""
    max_sequences: int
    """sequences the stage holds KV for"""
    cpu_weights: CpuWeights
    digest_cache: Path | None = None
    """where digests of model files are cached (the model cache); None: hash every time"""
    receiver: ModelReceiver | None = None
    """where ``mlxppctl prepare`` puts what it ships (None: this node takes nothing)"""
    missing_model: str | None = None
    """why this node has no model files yet: it listens holding no layers until prepared"""
    tensor: TensorPlace | None = None
    """its place in a tensor-parallel stage (None: a stage of one rank)"""
    roster: RosterBook | None = None
    """the node's shared roster (an agent's, replaced on reload); None: the TOML's"""


async def start_stage_worker(
    setup: StageSetup,
    mlx: MlxThread,
    extras: Callable[[], StageExtras] | None = None,
) -> tuple[StageWorker, tuple[str, int]]:
    """Load the stage's layers, listen on its address; returns the worker and where it listens."""
    raise_open_file_limit()  # a stage port must not run out of descriptors before the hard limit
    spec = setup.spec
    runner: StageRunner | None = None
    per_token = 0
    transport = create_transport(
        setup.transport,
        wire_config_for(setup.cluster, setup.node_id, setup.secret, setup.node_key, setup.roster),
    )
    tensor = links = None
    if setup.tensor is not None:
        links = FollowerLinks(transport)
        tensor = await _load_tensor_stage(setup, mlx, links.announce)
        runner, kv = tensor.runner, tensor.kv
        await links.connect(setup.tensor.node_ids, setup.tensor.addresses)
    elif not spec.is_standby:  # a standby loads a lost stage's layers when it adopts them
        runner, per_token = await load_stage_runner(
            mlx, setup.model_dir, spec, setup.model_config, weights=setup.cpu_weights,
            digest_cache=setup.digest_cache, adapters=AdapterPaths.of(setup.cluster),
        )  # fmt: skip
    if tensor is None:
        kv = stage_kv_manager(spec, per_token, setup.kv_budget_bytes, setup.max_sequences)
    prepare = None
    # A tensor-parallel stage's layers are fixed while it runs: its ranks load together.
    if setup.missing_model is None and tensor is None:
        prepare = layer_preparer(
            mlx,
            setup.model_dir,
            setup.model_config,
            setup.kv_budget_bytes,
            setup.max_sequences,
            setup.cpu_weights,
            setup.digest_cache,
            AdapterPaths.of(setup.cluster),
        )
    worker = StageWorker(
        spec, runner, kv, transport, mlx, extras=extras, prepare_layers=prepare,
        receiver=setup.receiver, missing_model=setup.missing_model,
        grammars=GrammarCompiles(
            functools.partial(load_tokenizer, setup.model_dir),
            setup.cluster.cluster.grammar_compile_limit_s,
        ),
    )  # fmt: skip
    if tensor is not None and setup.tensor is not None and links is not None:
        worker.slot_nodes = tuple(zip(setup.tensor.node_ids, tensor.slot_bytes, strict=True))
        worker.followers = links
        links.on_lost = worker.rank_lost
    address = await worker.start(setup.host, setup.port)
    if setup.missing_model is not None:
        log.warning(
            "%s listening on %s:%d without the model (%s); waiting for mlxppctl prepare",
            setup.node_id, *address, setup.missing_model,
        )  # fmt: skip
    elif runner is None:
        log.info("standby %s listening on %s:%d, holding no layers", setup.node_id, *address)
    else:
        log.info(
            "stage %d (%s) serving layers %d-%d on %s:%d, %.1f MB of parameters",
            spec.index, setup.node_id, spec.start, spec.end - 1, *address,
            runner.stage.parameter_bytes / 1e6,
        )  # fmt: skip
    return worker, address


async def _load_tensor_stage(
    setup: StageSetup, mlx: MlxThread, announce: Announce | None = None
) -> TensorStage:
    assert setup.tensor is not None
    return await load_tp_stage(
        mlx, setup.tensor, setup.model_dir, setup.spec, setup.model_config,
        budget_bytes=setup.kv_budget_bytes, max_sequences=setup.max_sequences,
        weights=setup.cpu_weights, digest_cache=setup.digest_cache, announce=announce,
    )  # fmt: skip


async def run_tensor_follower(
    setup: StageSetup, mlx: MlxThread, on_following: Callable[[], None] = lambda: None
) -> int:
    """A tensor-parallel rank above 0: load its shard with the others, then mirror rank 0
    until rank 0 stops (or the ring breaks); returns the calls it made. ``on_following``:
    called once its shard is loaded and it follows."""
    assert setup.tensor is not None
    transport = create_transport(
        setup.transport,
        wire_config_for(setup.cluster, setup.node_id, setup.secret, setup.node_key, setup.roster),
    )
    # Listening first: rank 0 connects as soon as every rank has loaded.
    inbox = RankZeroInbox(setup.tensor.node_ids[0])
    await inbox.listen(transport, setup.host, setup.port)
    try:
        tensor = await _load_tensor_stage(setup, mlx)
        on_following()
        log.info(
            "stage %d (%s) rank %d following rank 0, layers %d-%d, %.1f MB of parameters",
            setup.spec.index, setup.node_id, tensor.group.rank(), setup.spec.start,
            setup.spec.end - 1, tensor.runner.stage.parameter_bytes / 1e6,
        )  # fmt: skip
        channel = await inbox.channel
        trace = FollowerTrace(setup.spec.index, tensor.group.rank())
        calls = await follow_rank_zero(mlx, channel, tensor.runner, tensor.group, trace)
        log.info("rank %d: rank 0 stopped after %d calls here", tensor.group.rank(), calls)
        return calls
    finally:
        await inbox.close()


@dataclass(frozen=True)
class CoordinatorSetup:
    """Everything a coordinator's pipeline is built from."""

    cluster: ClusterConfig
    node_id: str
    secret: ClusterSecret
    node_key: NodeKey
    """this node's own key (the roster lists its public half)"""
    transport: str
    plan: tuple[LayerRange, ...]
    micro_batch_size: int
    parallel: int
    warmup: bool
    """send one 2-token request through every stage before serving"""
    align: bool = True
    """move stages that hold other ranges (an earlier repartition's) back to ``plan``"""
    trace_path: Path | None = None
    connect_timeout_s: float = 60.0
    model_config: dict[str, Any] | None = None
    """the model's config.json: with it, a lost stage's layers may go to the survivors"""
    model_dir: Path | None = None
    """the coordinator's copy of the model: with it (and model_config), every stage's
    identity is checked against it"""
    digest_cache: Path | None = None
    """where digests of model files are cached (the model cache)"""
    prompt_cache: int = 8
    """prompt prefixes the stages keep for reuse (0: none)"""
    prefill_chunk: int | None = None
    """prompt tokens per prefill pass (None: chosen per prompt, core/prefill_chunks.py)"""
    timeline: StartTimeline | None = None
    """where the connection, identity check and warm-up are marked as they happen"""
    roster: RosterBook | None = None
    """the node's shared roster (an agent's, replaced on reload); None: the TOML's"""


async def start_pipeline_coordinator(
    setup: CoordinatorSetup,
    tokenizer: Any,
    model_id: str,
    metrics: PipelineMetrics | None,
) -> Coordinator:
    """Connect to every stage in order, align their layers to the plan, warm up."""
    transport = create_transport(
        setup.transport,
        wire_config_for(setup.cluster, setup.node_id, setup.secret, setup.node_key, setup.roster),
    )
    coordinator = Coordinator(
        setup.cluster,
        transport,
        tokenizer,
        model_id,
        connect_timeout_s=setup.connect_timeout_s,
        micro_batch_size=setup.micro_batch_size,
        prompt_cache=setup.prompt_cache,
        parallel=setup.parallel,
        metrics=metrics,
        trace_path=setup.trace_path,
        plan=setup.plan,
        failover=FailoverSettings.from_policy(
            setup.cluster.cluster.failover,
            survivors_replan(setup.model_config) if setup.model_config is not None else None,
        ),
        identity=(
            IdentityReference(setup.model_dir, setup.model_config, setup.digest_cache)
            if setup.model_dir is not None and setup.model_config is not None
            else None
        ),
    )
    coordinator.prefill_chunk = setup.prefill_chunk
    if coordinator.identity is not None:
        coordinator.identity.adapters = coordinator.adapters.paths
    stages = len(setup.plan)
    log.info(
        "coordinator: decode in %s; prefill in %s",
        f"micro-batches of {setup.micro_batch_size}" if setup.micro_batch_size > 1
        else "single-sequence passes" if setup.micro_batch_size == 1
        else f"auto micro-batches (one per stage, {stages} stages, streams spread evenly)",
        f"chunks of {setup.prefill_chunk} tokens" if setup.prefill_chunk
        else "chunks sized per prompt (about 4 per stage; while others decode, what one decode"
        " pass costs, from the measured speed: 16 tokens until measured)",
    )  # fmt: skip
    mark = setup.timeline.mark if setup.timeline is not None else (lambda _what: None)
    mark(f"coordinator connecting to {stages} stages")
    try:
        await coordinator.start(warmup=False)
        nodes = ", ".join(n.id for n in coordinator.chain_nodes())
        checked = " and checked what each serves" if coordinator.identity is not None else ""
        mark(f"coordinator connected to every stage ({nodes}){checked}")
        if setup.align and await coordinator.align_stages():
            # The file's ranges win over an earlier elastic repartition's.
            log.info("coordinator: moved the stages back to the planned layers")
        if setup.warmup:
            await coordinator.warm()
            mark("warm: a 2-token request went through every stage")
    except BaseException:
        await coordinator.close()
        raise
    return coordinator
