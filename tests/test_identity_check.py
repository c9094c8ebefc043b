"""The coordinator checks what every stage serves before it serves anything (the path every
mode takes: ``start_pipeline_coordinator``). Real stage workers on loopback, a tiny checkpoint:
a stage whose one tensor differs is refused with ``model_mismatch`` naming both digests; the
same stage with the cluster's tensors is verified."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.model_identity import IdentityCheck
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.pipeline.identity_check import ModelMismatch
from mlxppd.runtime.pipeline.node_start import CoordinatorSetup, start_pipeline_coordinator
from mlxppd.runtime.pipeline.stage_worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.conftest import TINY_LLAMA
from tests.test_sequence_isolation import CLUSTER_TOML, stage_worker
from tests.wire_support import CLUSTER, SECRET, run

SPLIT = (StageSpec(0, 2, 0, 3), StageSpec(1, 2, 3, 6))
CHANGED = "model.layers.4.mlp.down_proj.weight"


def changed_copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    weights = mx.load(str(target / "model.safetensors"))
    assert isinstance(weights, dict)
    weights[CHANGED] = weights[CHANGED] + 1e-3  # same shape, other values
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    return target


async def connect(
    source: Path, stage_dirs: tuple[Path, Path]
) -> tuple[list[IdentityCheck], str | None]:
    """Stage i loads from ``stage_dirs[i]``; the coordinator's copy is ``source``. The checks,
    and the refusal when the coordinator refused to serve."""
    mlx = MlxThread("identity-mlx")
    workers: list[StageWorker] = [
        await stage_worker(d, mlx, spec) for d, spec in zip(stage_dirs, SPLIT, strict=True)
    ]
    try:
        ports = [(await w.start("127.0.0.1", 0))[1] for w in workers]
        cluster = parse_cluster_config(
            CLUSTER_TOML.format(name=CLUSTER, port0=ports[0], port1=ports[1]), "test.toml"
        )
        setup = CoordinatorSetup(
            cluster=cluster, node_id="coordinator", secret=SECRET, transport="tcp",
            plan=(LayerRange(0, 3), LayerRange(3, 6)), micro_batch_size=1, parallel=4,
            warmup=False, align=False,
            model_config=json.loads((source / "config.json").read_text()), model_dir=source,
        )  # fmt: skip
        try:
            coordinator = await start_pipeline_coordinator(setup, None, "tiny", None)
        except ModelMismatch as exc:
            return exc.checks, str(exc)
        checks = coordinator.identity_checks
        await coordinator.close()
        return checks, None
    finally:
        for worker in workers:
            await worker.close()
        mlx.close()


def test_a_stage_with_one_changed_tensor_is_refused_naming_both_digests(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model("identity-llama", TINY_LLAMA)
    wrong = changed_copy(source, tmp_path / "wrong")
    checks, message = run(lambda: connect(source, (source, wrong)))
    assert [c.state for c in checks] == ["verified", "mismatch"]
    refused = checks[1]
    assert refused.expected is not None and refused.actual is not None
    assert refused.expected.tensors_sha256 != refused.actual.tensors_sha256
    assert message is not None and message.startswith(
        "model_mismatch: stage 1 (node stage-1): its tensors differ"
    )
    assert refused.expected.short() in message and refused.actual.short() in message


def test_stages_with_the_clusters_tensors_are_verified(
    tiny_model: Callable[..., Path],
) -> None:
    source = tiny_model("identity-llama", TINY_LLAMA)
    checks, refused = run(lambda: connect(source, (source, source)))
    assert refused is None and [c.state for c in checks] == ["verified", "verified"]
    assert [c.actual.layers for c in checks if c.actual] == [(0, 3), (3, 6)]
