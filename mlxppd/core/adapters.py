"""LoRA adapters: what an adapter directory says, and which of its tensors a stage reads (pure).

Two layouts are read. mlx-lm's (``mlx_lm lora --train`` writes it): ``adapter_config.json``
with ``fine_tune_type`` (lora or dora) and ``lora_parameters`` {rank, scale, ...}, and
``adapters.safetensors`` whose tensors are named after the module they adapt
(``model.layers.12.self_attn.q_proj.lora_a``, ``lora_b``, DoRA's ``m``). PEFT's:
``adapter_config.json`` with ``r``, ``lora_alpha`` (``use_rslora``, ``use_dora``) and
``adapter_model.safetensors`` named ``base_model.model.<module>.lora_A.weight`` (transposed
relative to mlx-lm's). Both come out as :class:`AdapterTensorName` values with mlx-lm's module
paths, so a stage filters them by the layer index in the path and reads only its own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.log_text import escape
from mlxppd.core.stage_tensors import owned_by
from mlxppd.core.stages import StageSpec

__all__ = [
    "AdapterConfig",
    "AdapterTensorName",
    "adapter_config",
    "adapter_name_problem",
    "parse_adapter_flag",
    "tensor_name",
    "wanted_by",
]

MLX_FILE = "adapters.safetensors"
PEFT_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
#: the name a per-request adapter is chosen by (the request's ``model``)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")

Kind = Literal["lora", "dora"]
Naming = Literal["mlx", "peft"]


@dataclass(frozen=True)
class AdapterConfig:
    """One adapter as its config file describes it."""

    kind: Kind
    rank: int
    scale: float
    """the low-rank update is multiplied by this (mlx-lm's ``scale``; PEFT's alpha / r)"""
    naming: Naming
    weights_file: str
    """the safetensors file in the adapter directory"""


@dataclass(frozen=True)
class AdapterTensorName:
    """Where one stored adapter tensor goes: a module of the model and mlx-lm's leaf name."""

    module: str
    """mlx-lm's module path, e.g. ``model.layers.12.self_attn.q_proj``"""
    leaf: Literal["lora_a", "lora_b", "m"]
    transpose: bool
    """PEFT stores lora_A / lora_B transposed relative to mlx-lm's lora_a / lora_b"""


def adapter_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a per-request adapter (None: it can)."""
    if not _NAME.match(name):
        return (
            f"{name!r} is not an adapter name: use 1 to 64 letters, digits, '.', '_', ':' or "
            "'-', starting with a letter or digit (clients send it as the request's model)"
        )
    return None


def parse_adapter_flag(text: str) -> tuple[str | None, str]:
    """``--adapter DIR`` (None: the fused adapter) or ``--adapter NAME=DIR`` (a named one)."""
    name, sep, path = text.partition("=")
    if not sep:
        return None, text
    if not path:
        raise ConfigurationError(f"{text!r} names no directory; use NAME=DIR", source="--adapter")
    problem = adapter_name_problem(name)
    if problem is not None:
        raise ConfigurationError(problem, source="--adapter")
    return name, path


def _shown(value: Any) -> str:
    """A config value in an error: short and escaped (the file is outside text)."""
    return escape(repr(value), 40)


def _number(data: dict[str, Any], key: str, source: str, low: float, high: float) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigurationError(
            f"{key} = {_shown(value)} is not a number from {low:g} to {high:g}", source=source
        )
    return float(value)


def adapter_config(data: Any, files: set[str], source: str) -> AdapterConfig:
    """The adapter described by ``adapter_config.json``'s content ``data``; ``files``: the
    names in its directory. ``source`` names the file in errors."""
    if not isinstance(data, dict):
        raise ConfigurationError("is not a JSON object", source=source)
    if "peft_type" in data or "lora_alpha" in data:
        if str(data.get("peft_type", "LORA")).upper() != "LORA":
            raise ConfigurationError(
                f"peft_type {_shown(data.get('peft_type'))} is not a LoRA adapter; only LoRA and "
                "DoRA adapters are served",
                source=source,
            )
        if PEFT_FILE not in files:
            raise ConfigurationError(f"a PEFT adapter needs {PEFT_FILE} beside it", source=source)
        for key in ("rank_pattern", "alpha_pattern"):
            if data.get(key):
                raise ConfigurationError(
                    f"{key} gives some modules their own rank or alpha, which is not "
                    "supported; merge it with PEFT or retrain with one rank and alpha",
                    source=source,
                )
        rank = _number(data, "r", source, 1, 65536)
        alpha = _number(data, "lora_alpha", source, 1e-6, 1e9)
        scale = alpha / math.sqrt(rank) if data.get("use_rslora") else alpha / rank
        kind: Kind = "dora" if data.get("use_dora") else "lora"
        return AdapterConfig(kind, int(rank), scale, "peft", PEFT_FILE)
    fine_tune = data.get("fine_tune_type", "lora")
    if fine_tune == "full":
        raise ConfigurationError(
            "fine_tune_type 'full' is a fine-tuned model, not an adapter; fuse it with "
            "`mlx_lm fuse` and serve the result as --model",
            source=source,
        )
    if fine_tune not in ("lora", "dora"):
        raise ConfigurationError(
            f"fine_tune_type {_shown(fine_tune)} is not lora or dora", source=source
        )
    params = data.get("lora_parameters")
    if not isinstance(params, dict):
        raise ConfigurationError(
            "has no lora_parameters {rank, scale, ...}; is this an mlx-lm adapter?", source=source
        )
    where = f"{source}: lora_parameters"
    rank = _number(params, "rank", where, 1, 65536)
    scale = _number(params, "scale", where, -1e9, 1e9)
    weights = MLX_FILE if MLX_FILE in files else PEFT_FILE if PEFT_FILE in files else None
    if weights is None:
        raise ConfigurationError(f"has no {MLX_FILE} beside it", source=source)
    return AdapterConfig(fine_tune, int(rank), scale, "mlx", weights)


_PEFT = re.compile(
    r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B|lora_magnitude_vector)(?:\.weight)?$"
)
_MLX = re.compile(r"^(.+)\.(lora_a|lora_b|m)$")


def tensor_name(name: str, naming: Naming) -> AdapterTensorName | None:
    """Where stored tensor ``name`` goes (None: not an adapter tensor of this layout)."""
    if naming == "peft":
        found = _PEFT.match(name)
        if found is None:
            return None
        leaf = {"lora_A": "lora_a", "lora_B": "lora_b", "lora_magnitude_vector": "m"}
        kind = found.group(2)
        return AdapterTensorName(found.group(1), leaf[kind], kind != "lora_magnitude_vector")  # type: ignore[arg-type]
    found = _MLX.match(name)
    if found is None:
        return None
    return AdapterTensorName(found.group(1), found.group(2), False)  # type: ignore[arg-type]


def wanted_by(module: str, spec: StageSpec | None, tied_embeddings: bool) -> bool:
    """True when a stage holding ``spec`` runs ``module`` (None: every module, one process)."""
    return spec is None or owned_by(f"{module}.weight", spec, tied_embeddings)
