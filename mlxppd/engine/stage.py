"""A loaded pipeline stage: its module with only its own weights, and its accounting."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.stages import StageSpec
from mlxppd.engine.families import StageModel, family_for
from mlxppd.engine.model_files import load_tensors, read_config


@dataclass
class LoadedStage:
    """One stage ready to run: ``model(x, cache)`` plus what it holds."""

    spec: StageSpec
    model: StageModel
    config: dict[str, Any]
    parameter_bytes: int

    def make_cache(self) -> list[Any]:
        return self.model.make_cache()

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        return self.model(x, cache)


def _quant_params(
    config: dict[str, Any],
    global_path: str,
    module: nn.Module,
    weights: dict[str, mx.array],
    local_path: str,
) -> dict[str, Any]:
    """Bits, group size and mode of one saved quantized module (mlx-lm's conventions)."""
    quant = config.get("quantization") or config.get("quantization_config") or {}
    override = quant.get(global_path)
    if isinstance(override, dict):
        return dict(override)
    scales = weights[f"{local_path}.scales"]
    in_dims = module.weight.shape[-1]
    group_size = in_dims // scales.shape[-1]
    bits = (weights[f"{local_path}.weight"].shape[-1] * 32) // in_dims
    mode = quant.get("mode", "affine") if scales.dtype == mx.uint8 else "affine"
    return {"group_size": group_size, "bits": bits, "mode": mode}


def load_stage(
    model_dir: Path, spec: StageSpec, config: dict[str, Any] | None = None
) -> LoadedStage:
    """Build the stage's module and load only the tensors it owns."""
    config = config or read_config(model_dir)
    family = family_for(config)
    total = family.num_layers(config)
    if spec.end > total or spec.start < 0 or spec.start >= spec.end:
        raise ConfigurationError(
            f"stage {spec.index} asks for layers {spec.start}-{spec.end - 1} "
            f"but the model has layers 0-{total - 1}",
            source="--pp-layers",
        )
    model = family.build_stage(config, spec)
    assert isinstance(model, nn.Module)

    raw = load_tensors(model_dir, lambda name: model.local_weight_name(name) is not None)
    local_to_global = {str(model.local_weight_name(k)): k for k in raw}
    local = {local_name: raw[name] for local_name, name in local_to_global.items()}

    if config.get("quantization") or config.get("quantization_config"):

        def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
            if not hasattr(module, "to_quantized") or f"{path}.scales" not in local:
                return False
            global_path = local_to_global[f"{path}.weight"][: -len(".weight")]
            return _quant_params(config, global_path, module, local, path)

        nn.quantize(model, class_predicate=predicate)

    # strict: a missing tensor is a broken checkpoint or a wrong split, never silently random.
    model.load_weights(list(local.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    nbytes = sum(v.nbytes for _, v in params)
    return LoadedStage(spec=spec, model=model, config=config, parameter_bytes=nbytes)
