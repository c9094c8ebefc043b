"""A tensor-parallel stage's ranks coming up: joining the ring, loading the shard, agreeing on
what each (stage, rank) slot holds.

Every rank of the stage runs ``load_tp_stage`` at once (sharding and the KV probe are
collectives), then they exchange what they hold and what KV they may use, so rank 0 can admit
for every slot (``core/kv_admission.py``'s ``SlotKvManager``). Rank 0 then serves as any stage
does; the others follow it (``engine/tp_mirror.py``, over ``tp_links.py``) until it stops or
their ring breaks.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxppd.core.agent.desired import tensor_fields
from mlxppd.core.config.cluster import ClusterConfig, Node
from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.kv_admission import UNLIMITED_BYTES, SlotKvManager, StageKvManager
from mlxppd.core.stages import StageSpec
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.engine.tensor_parallel import hostfile, init_group, tp_address_warning, tp_refusal
from mlxppd.engine.tp_mirror import Announce, gather_ints
from mlxppd.runtime.stage.loader import load_stage_runner
from mlxppd.runtime.system.mlx_thread import MlxThread

__all__ = ["TensorPlace", "TensorStage", "load_tp_stage", "tensor_place"]

log = logging.getLogger("mlxppd.stage")

#: how long a rank keeps trying to join its stage's ring
JOIN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class TensorPlace:
    """Where a node sits in its stage's tensor-parallel group."""

    rank: int
    ring: tuple[str, ...]
    """every rank's ring address (host:port), rank order"""
    node_ids: tuple[str, ...]
    """every rank's node id, rank order"""
    addresses: tuple[str, ...]
    """every rank's transport address (host:port), rank order: rank 0 announces its calls to
    the others there"""


def tensor_place(cluster: ClusterConfig, node: Node) -> TensorPlace | None:
    """``node``'s place in a 2D cluster (None: a pipeline-only cluster)."""
    f = tensor_fields(cluster, node)
    if not f:
        return None
    return TensorPlace(f["tp_rank"], f["tp_ring"], f["tp_nodes"], f["tp_addresses"])


@dataclass
class TensorStage:
    """One rank's loaded shard and, on rank 0, the accounting of every slot."""

    group: mx.distributed.Group
    runner: StageRunner
    kv: StageKvManager
    slot_bytes: tuple[int, ...]
    """every rank's shard of the weights, bytes, rank order"""


def _join(place: TensorPlace, workdir: Path) -> mx.distributed.Group:
    for address in place.ring:
        warning = tp_address_warning(address.rsplit(":", 1)[0])
        if warning is not None:
            log.warning("%s", warning)
    # MLX's ring backend reads its rank and the ring from the environment at init.
    hosts = workdir / "tp-hostfile.json"
    hosts.write_text(hostfile(list(place.ring)))
    os.environ["MLX_RANK"] = str(place.rank)
    os.environ["MLX_HOSTFILE"] = str(hosts)
    # A rank gives up connecting after about 30 s; the others may start minutes later (one
    # agent per host), so it tries again until JOIN_TIMEOUT_S.
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        try:
            return init_group(len(place.ring))
        except RuntimeError as exc:
            if time.monotonic() > deadline or not str(exc).startswith("[ring]"):
                raise
            log.info(
                "rank %d: the other ranks are not there yet (%s); trying again", place.rank, exc
            )


async def load_tp_stage(
    mlx: MlxThread,
    place: TensorPlace,
    model_dir: Path,
    spec: StageSpec,
    config: dict[str, Any],
    *,
    budget_bytes: int | None,
    max_sequences: int,
    weights: CpuWeights,
    digest_cache: Path | None,
    announce: Announce | None = None,
) -> TensorStage:
    """Join the ring (blocks until every rank has), load and shard the stage's layers, and
    agree on every slot's bytes and KV limits. ``announce``: rank 0's way to its followers."""
    refusal = tp_refusal(config, len(place.ring))
    if refusal is not None:
        raise ConfigurationError(refusal, key="cluster.tensor_parallel_size")
    with tempfile.TemporaryDirectory(prefix="mlxpp-tp-") as tmp:
        group = await mlx.run(lambda: _join(place, Path(tmp)))
    log.info(
        "stage %d: tensor-parallel rank %d of %d joined its ring (%s)",
        spec.index, place.rank, group.size(), ", ".join(place.ring),
    )  # fmt: skip
    runner, per_token = await load_stage_runner(
        mlx, model_dir, spec, config, weights=weights, digest_cache=digest_cache, group=group,
        announce=announce,
    )  # fmt: skip
    mine = [runner.stage.parameter_bytes, budget_bytes or UNLIMITED_BYTES, max_sequences, per_token]
    table = await mlx.run(lambda: gather_ints(mine, group))
    slots = [
        StageKvManager(spec.index, budget, per, sequences, rank=rank)
        for rank, (_, budget, sequences, per) in enumerate(table)
    ]
    own = slots[place.rank]
    kv = SlotKvManager(
        own.stage_index, own.budget_bytes, own.bytes_per_token, own.max_sequences,
        rank=place.rank, others=[s for s in slots if s is not own],
    )  # fmt: skip
    return TensorStage(group, runner, kv, tuple(row[0] for row in table))
