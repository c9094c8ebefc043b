"""Loading one stage's layers and sizing its KV accounting (shared by serve and the agent)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxppd.core.config.cluster import ClusterConfig
from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.kv_admission import UNLIMITED_BYTES, StageKvManager
from mlxppd.core.protocol.control import LayerLoad
from mlxppd.core.stages import StageSpec
from mlxppd.engine.blas import blas_in_use
from mlxppd.engine.families.base import text_config
from mlxppd.engine.kv_sizing import kv_bytes_per_token
from mlxppd.engine.stage import load_stage
from mlxppd.engine.stage_digest import stage_identity
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.engine.tensor_parallel import shard_stage
from mlxppd.engine.tp_mirror import Announce, MirroredRunner
from mlxppd.runtime.system.mlx_thread import MlxThread

log = logging.getLogger("mlxppd.stage")


@dataclass(frozen=True)
class AdapterPaths:
    """The adapters a stage loads: one fused into its weights, and named ones per request."""

    fused: Path | None = None
    named: Mapping[str, Path] = field(default_factory=dict)

    @staticmethod
    def of(cluster: ClusterConfig) -> AdapterPaths:
        fused = cluster.cluster.adapter
        return AdapterPaths(
            Path(fused).expanduser() if fused else None,
            {a.name: Path(a.path).expanduser() for a in cluster.adapters},
        )


async def load_stage_runner(
    mlx: MlxThread,
    model_dir: Path,
    spec: StageSpec,
    config: dict[str, Any],
    *,
    reuse: StageRunner | None = None,
    weights: CpuWeights = CpuWeights.AUTO,
    digest_cache: Path | None = None,
    group: mx.distributed.Group | None = None,
    announce: Announce | None = None,
    adapters: AdapterPaths | None = None,
) -> tuple[StageRunner, int]:
    """The stage's runner and its KV bytes per token, loaded on the mlx thread.

    ``group``: this rank's tensor-parallel group; the stage keeps only its shard of the layers
    and the KV bytes are this rank's (its share of the KV heads). Every rank of the group must
    load at once: sharding and the KV probe run collectives. Rank 0's runner announces each
    call to the others (``engine/tp_mirror.py``).

    ``reuse``: the runner being replaced; its tensors for layers the new spec keeps are taken
    over, so only the gained layers are read (``runner.stage.loaded_tensors`` counts them).
    The stage's identity is taken from the same files (``engine/stage_digest.py``; hashes
    cached in ``digest_cache``)."""

    def load() -> tuple[StageRunner, int]:
        old = reuse.stage if reuse is not None else None
        paths = adapters or AdapterPaths()
        stage = load_stage(
            model_dir, spec, config, reuse=old, weights_mode=weights,
            adapter=paths.fused,
            # A repartition keeps the named adapters held now (some loaded while serving).
            adapters=paths.named if adapters is not None and old is None else None,
        )  # fmt: skip
        identity = stage_identity(model_dir, spec, config, digest_cache)
        if stage.adapters is not None:
            identity = identity.model_copy(update={"adapters": dict(stage.adapters.digests())})
            for info in (stage.adapters.fused, *stage.adapters.named.values()):
                if info is not None:
                    log.info(
                        "stage %d: adapter %s (%s, %s) on %d modules, %d of its %d tensors read",
                        spec.index, info.name or "fused", info.path, info.kind, info.modules,
                        info.read, info.stored,
                    )  # fmt: skip
        stage = replace(stage, identity=identity)
        if group is not None:
            stage = shard_stage(stage, group)
        log.info(
            "stage %d: layers %d-%d, %.1f MB of parameters, weights %s, BLAS %s",
            spec.index, spec.start, spec.end - 1, stage.parameter_bytes / 1e6,
            stage.weights_reason, blas_in_use(),
        )  # fmt: skip
        per_token = kv_bytes_per_token(stage, int(text_config(config)["hidden_size"]))
        if group is not None and group.rank() == 0:
            if announce is None:
                raise ValueError("rank 0 of a tensor-parallel stage needs a way to its ranks")
            return MirroredRunner(stage, group, announce), per_token
        return StageRunner(stage), per_token

    return await mlx.run(load)


def layer_preparer(
    mlx: MlxThread,
    model_dir: Path,
    config: dict[str, Any],
    budget_bytes: int | None,
    max_sequences: int,
    weights: CpuWeights = CpuWeights.AUTO,
    digest_cache: Path | None = None,
    adapters: AdapterPaths | None = None,
) -> Callable[
    [StageSpec, StageRunner | None], Awaitable[tuple[StageRunner, StageKvManager, LayerLoad]]
]:
    """The stage worker's ``prepare_layers``: new layers beside the old, reusing what it can."""

    async def prepare(
        spec: StageSpec, current: StageRunner | None
    ) -> tuple[StageRunner, StageKvManager, LayerLoad]:
        started = time.monotonic()
        runner, per_token = await load_stage_runner(
            mlx, model_dir, spec, config, reuse=current, weights=weights,
            digest_cache=digest_cache, adapters=adapters,
        )  # fmt: skip
        kv = stage_kv_manager(spec, per_token, budget_bytes, max_sequences)
        load = LayerLoad(
            layers=(spec.start, spec.end),
            loaded_tensors=runner.stage.loaded_tensors,
            reused_tensors=runner.stage.reused_tensors,
            load_s=time.monotonic() - started,
        )
        return runner, kv, load

    return prepare


def stage_kv_manager(
    spec: StageSpec,
    bytes_per_token: int,
    budget_bytes: int | None,
    max_sequences: int,
    rank: int | None = None,
) -> StageKvManager:
    return StageKvManager(
        stage_index=spec.index,
        budget_bytes=budget_bytes or UNLIMITED_BYTES,
        bytes_per_token=bytes_per_token,
        max_sequences=max_sequences,
        rank=rank,
    )
