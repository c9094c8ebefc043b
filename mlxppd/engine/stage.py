"""Loading one pipeline stage: mlx-lm's model for the family, pruned, with only its own weights.

Every checkpoint tensor is opened lazily, the family's ``sanitize`` runs once over the whole
(lazy) weight map, so expert stacks and split projections come out the same on every stage, and
only the tensors the pruned model still has are ever evaluated, i.e. read from disk.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.model_identity import StageIdentity
from mlxppd.core.profile.families import FAMILIES
from mlxppd.core.profile.model import read_model_config
from mlxppd.core.stages import StageSpec
from mlxppd.engine.adapters.stage_adapters import StageAdapters, attach_adapters
from mlxppd.engine.cpu_weights import float32_weights, resolve_for_stage
from mlxppd.engine.families import family_for
from mlxppd.engine.families.base import Family, StageNet
from mlxppd.engine.model_files import load_tensors


@dataclass
class LoadedStage:
    """One stage ready to run: ``stage(x, cache)`` plus what it holds."""

    spec: StageSpec
    net: StageNet
    config: dict[str, Any]
    parameter_bytes: int
    loaded_tensors: int = 0
    """tensors read from the checkpoint for this stage"""
    reused_tensors: int = 0
    """tensors taken over from the stage it replaced (a repartition keeps its layers)"""
    weights: CpuWeights = CpuWeights.NATIVE
    """native: as the checkpoint stores them; float32: materialized in float32 at load"""
    weights_reason: str = "native"
    """why this weight mode, for the log"""
    identity: StageIdentity | None = None
    """what it serves, from the files it read (set by the loader that hashes them)"""
    adapters: StageAdapters | None = None
    """its LoRA adapters: fused at load, and the per-request ones (``engine/adapters``)"""

    def make_cache(self) -> list[Any]:
        return self.net.make_cache()

    def __call__(self, x: mx.array, cache: list[Any], head: bool = True) -> mx.array:
        return self.net(x, cache, head)


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's (Model, ModelArgs) classes for a config.

    A family this build runs whose model_type names an mlx-lm models module is that module,
    as mlx-lm's own lookup finds it (``tests/engine/test_family_parity.py`` checks they
    agree), without importing ``mlx_lm.utils`` and ``transformers`` with it; other types
    (remapped ones, such as mistral) go through mlx-lm's lookup."""
    model_type = str(config.get("model_type"))
    if model_type in FAMILIES and importlib.util.find_spec(f"mlx_lm.models.{model_type}"):
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
        return module.Model, module.ModelArgs
    from mlx_lm.utils import _get_classes

    return cast(tuple[Any, Any], _get_classes(config))


def _quant_params(
    config: dict[str, Any], path: str, module: nn.Module, weights: dict[str, mx.array]
) -> dict[str, Any] | bool:
    """mlx-lm's rule: quantize a module iff the checkpoint has its scales; read bits from shapes."""
    if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
        return False
    quant = config.get("quantization") or {}
    override = quant.get(path)
    if isinstance(override, dict):
        return dict(override)
    scales = weights[f"{path}.scales"]
    in_dims = module.weight.shape[-1]
    group_size = in_dims // scales.shape[-1]
    bits = (weights[f"{path}.weight"].shape[-1] * 32) // in_dims
    mode = quant.get("mode", "affine") if scales.dtype == mx.uint8 else "affine"
    return {"group_size": group_size, "bits": bits, "mode": mode}


def load_stage(
    model_dir: Path,
    spec: StageSpec,
    config: dict[str, Any] | None = None,
    *,
    reuse: LoadedStage | None = None,
    weights_mode: CpuWeights = CpuWeights.NATIVE,
    adapter: Path | None = None,
    adapters: Mapping[str, Path] | None = None,
) -> LoadedStage:
    """Build the stage's module and load only the tensors it owns.

    ``reuse``: the stage this one replaces (a repartition). Tensors it already holds under the
    same name are taken over as they are (names carry global layer indices), so only the layers
    gained are read; the layers lost go when ``reuse`` is dropped.
    ``weights_mode``: FLOAT32 dequantizes and casts the stage's tensors to float32; AUTO picks
    it on a CPU host with an optimized BLAS and room for it (``engine.cpu_weights``).
    ``adapter``: an adapter directory fused into the weights; ``adapters``: named adapters kept
    apart, each request choosing one (``engine/adapters``). Only the stage's layers' adapter
    tensors are read.
    """
    config = config or read_model_config(model_dir)
    family = _family_for_split(config, spec)
    if reuse is not None and reuse.adapters is not None:
        if adapters is None:  # a repartition keeps the adapters requests choose
            adapters = {n: Path(i.path) for n, i in reuse.adapters.named.items()}
        if reuse.adapters.fused is not None:
            reuse = None  # its weights have the fused adapter in them: read the layers again
    weights_mode, weights_reason = resolve_for_stage(weights_mode, config, spec)

    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    # sanitize sees the whole (lazy) map: some families decide a conversion from tensors of
    # other layers (Qwen3.5's norm offset, Qwen3-Next's expert stacking).
    weights = load_tensors(model_dir, lambda _name: True)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    family.prune(model, spec)

    quantized = bool(config.get("quantization") or config.get("quantization_config"))
    if weights_mode is CpuWeights.FLOAT32:
        # The model keeps plain float modules; the packed tensors become float32 matrices.
        rule = (lambda p, m: _quant_params(config, p, m, weights)) if quantized else _never
        weights = float32_weights(model, weights, rule)
    elif quantized:
        nn.quantize(model, class_predicate=lambda p, m: _quant_params(config, p, m, weights))

    expected = [name for name, _ in _flat(model)]
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ConfigurationError(
            f"the checkpoint lacks {len(missing)} tensors stage {spec.index} needs "
            f"(first: {missing[0]}); is the model directory complete?",
            source=str(model_dir),
        )
    chosen, reused = _take_over(expected, weights, reuse)
    # strict: every parameter is replaced by a checkpoint tensor of the same shape.
    model.load_weights(chosen, strict=True)
    # Only the lazily opened tensors are read here; reused ones are already in memory.
    mx.eval(model.parameters())
    model.eval()
    held = attach_adapters(model, spec, config, family, adapter, adapters)
    nbytes = held_bytes(model)
    return LoadedStage(
        spec=spec,
        net=StageNet(family, model, spec),
        config=config,
        parameter_bytes=nbytes,
        loaded_tensors=len(expected) - reused,
        reused_tensors=reused,
        weights=weights_mode,
        weights_reason=weights_reason,
        adapters=held,
    )


def _never(_path: str, _module: nn.Module) -> bool:
    return False


def _flat(model: nn.Module) -> list[tuple[str, mx.array]]:
    return cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))


def held_bytes(model: nn.Module) -> int:
    """Bytes of every parameter ``model`` holds (what a stage reports as its weights)."""
    return sum(v.nbytes for _, v in _flat(model))


def _family_for_split(config: dict[str, Any], spec: StageSpec) -> Family:
    """The model's family, once the stage's layer range is known to be one it can hold."""
    family = family_for(config)
    total = family.num_layers(config)
    if spec.end > total or spec.start < 0 or spec.start >= spec.end:
        raise ConfigurationError(
            f"stage {spec.index} asks for layers {spec.start}-{spec.end - 1} "
            f"but the model has layers 0-{total - 1}",
            source="--pp-layers",
        )
    family.check_split(config, spec)
    return family


def _take_over(
    expected: list[str], weights: dict[str, mx.array], reuse: LoadedStage | None
) -> tuple[list[tuple[str, mx.array]], int]:
    """Each parameter's tensor: the replaced stage's when it holds the same one (a repartition
    keeps its layers), else the checkpoint's. Returns them and how many were taken over."""
    held = dict(_flat(reuse.net.model)) if reuse is not None else {}
    chosen = []
    reused = 0
    for name in expected:
        old, new = held.get(name), weights[name]
        if old is not None and old.shape == new.shape and old.dtype == new.dtype:
            chosen.append((name, old))
            reused += 1
        else:
            chosen.append((name, new))
    return chosen, reused
