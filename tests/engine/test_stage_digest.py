"""A stage's identity covers exactly the checkpoint tensors its layers own: one changed value
in a stage's range changes that stage's digest and no other's; the coordinator's comparison
refuses a stage that differs, holds no copy, or cannot run the family."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlxppd.core.model_identity import StageIdentity, check_stage
from mlxppd.core.stage_tensors import layer_of, owned_by
from mlxppd.core.stages import StageSpec
from mlxppd.engine.stage import load_stage
from mlxppd.engine.stage_digest import stage_identity
from tests.conftest import TINY_LLAMA

SPLIT = (StageSpec(0, 2, 0, 3), StageSpec(1, 2, 3, 6))


def digests(model: Path) -> list[str]:
    config = json.loads((model / "config.json").read_text())
    return [stage_identity(model, spec, config).tensors_sha256 for spec in SPLIT]


def test_tensors_belong_to_their_layer_or_to_an_end_of_the_pipeline() -> None:
    assert layer_of("model.layers.12.mlp.up_proj.weight") == 12
    assert layer_of("model.embed_tokens.weight") is None
    first, last = SPLIT
    assert owned_by("model.layers.2.self_attn.q_proj.weight", first, False)
    assert not owned_by("model.layers.2.self_attn.q_proj.weight", last, False)
    assert owned_by("model.embed_tokens.weight", first, False)
    assert not owned_by("model.embed_tokens.weight", last, False)
    assert owned_by("model.embed_tokens.weight", last, True)  # tied output head
    assert owned_by("lm_head.weight", last, False) and owned_by("model.norm.weight", last, False)


def test_the_digest_covers_what_the_stage_loads(tiny_model: Callable[..., Path]) -> None:
    model = tiny_model("digest-llama", TINY_LLAMA)
    config = json.loads((model / "config.json").read_text())
    for spec in SPLIT:
        identity = stage_identity(model, spec, config)
        assert identity.tensors == load_stage(model, spec, config).loaded_tensors
        assert identity.family == "llama" and identity.quantization == "none"


def test_one_changed_value_changes_only_its_stages_digest(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model("digest-llama", TINY_LLAMA)
    before = digests(model)
    assert before[0] != before[1] and digests(model) == before  # distinct, and stable
    changed = tmp_path / "changed"
    shutil.copytree(model, changed)
    weights = mx.load(str(changed / "model.safetensors"))
    assert isinstance(weights, dict)
    name = "model.layers.4.mlp.down_proj.weight"  # stage 1's range, same shape
    weights[name] = weights[name] + 1e-3
    mx.save_safetensors(str(changed / "model.safetensors"), weights)
    after = digests(changed)
    assert after[0] == before[0] and after[1] != before[1]


def _identity(model: Path, spec: StageSpec) -> StageIdentity:
    return stage_identity(model, spec, json.loads((model / "config.json").read_text()))


def test_the_coordinator_refuses_a_stage_that_differs_holds_nothing_or_cannot_run_the_family(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model("digest-llama", TINY_LLAMA)
    ours = _identity(model, SPLIT[1])
    other = ours.model_copy(update={"tensors_sha256": "0" * 64})
    common = {"family": "llama", "families": ["llama", "qwen3"], "cluster_family": "llama"}
    same = check_stage("b", 1, model_state="loaded", actual=ours, expected=ours, **common)
    assert same.state == "verified"
    differs = check_stage("b", 1, model_state="loaded", actual=other, expected=ours, **common)
    assert differs.state == "mismatch" and differs.detail.startswith("model_mismatch: stage 1")
    assert ours.short() in differs.detail and other.short() in differs.detail  # both digests
    none = check_stage("b", 1, model_state="missing", actual=None, expected=ours, **common)
    assert none.state == "missing" and "mlxppctl prepare" in none.detail
    cannot = check_stage(
        "b", 1, model_state="loaded", actual=ours, expected=ours,
        family="llama", families=["qwen3"], cluster_family="llama",
    )  # fmt: skip
    assert cannot.state == "mismatch" and "pipeline capability mismatch" in cannot.detail
    unknown = check_stage("b", 1, model_state="loaded", actual=ours, expected=None, **common)
    assert unknown.state == "unverified"
