"""The coordinator checks what every stage serves before it serves anything (the path every
mode takes: ``start_pipeline_coordinator``). Real stage workers on loopback, a tiny checkpoint:
a stage whose one tensor differs is refused with ``model_mismatch`` naming both digests; the
same stage with the cluster's tensors is verified."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlxppd.core.model_identity import IdentityCheck
from mlxppd.runtime.coordinator.identity_check import ModelMismatch
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.conftest import TINY_LLAMA
from tests.support.pipelines import SPLIT, pipeline, stage_worker
from tests.support.wire import run

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
    workers = [await stage_worker(d, mlx, spec) for d, spec in zip(stage_dirs, SPLIT, strict=True)]
    try:
        async with pipeline(workers, mlx, source) as coordinator:
            return coordinator.identity_checks, None
    except ModelMismatch as exc:
        return exc.checks, str(exc)


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
