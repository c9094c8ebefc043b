"""How a stage holds its weights on a CPU host: as the checkpoint stores them, or as float32.

On a CPU, MLX's quantized matmul does not use BLAS, while a float32 matmul runs on it. With an
optimized BLAS (OpenBLAS) under mlx, a 4-bit checkpoint materialized in float32 at load prefills
about 30x faster and decodes about 1.8x faster than the packed weights (bench/generate.py),
at 8x the memory of 4-bit weights. ``auto`` takes that trade where it pays and fits: a host
whose mlx runs on the CPU, with an optimized BLAS, and memory for the float32 stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import WithJsonSchema

from mlxppd.core.errors import ConfigurationError


class CpuWeights(StrEnum):
    """``--cpu-weights``: what a stage does with its weights on a CPU host."""

    AUTO = "auto"
    NATIVE = "native"
    FLOAT32 = "float32"


#: the config field's type: the schema inlines the choices (no separate enum definition)
CpuWeightsField = Annotated[
    CpuWeights, WithJsonSchema({"type": "string", "enum": [m.value for m in CpuWeights]})
]


def parse_cpu_weights(text: str, source: str = "--cpu-weights") -> CpuWeights:
    try:
        return CpuWeights(text.strip().lower())
    except ValueError:
        raise ConfigurationError(
            f"{text!r} is not a weight mode; use auto, native or float32", source=source
        ) from None


@dataclass(frozen=True)
class ComputeHost:
    """What decides ``auto`` on one host."""

    cpu_only: bool
    """mlx computes on the CPU here (no Metal or CUDA device)"""
    optimized_blas: bool
    """an optimized BLAS is under mlx (not the mlx[cpu] wheel's reference BLAS)"""
    available_bytes: int | None = None
    """memory free for this stage's weights, bytes (None: unknown, not checked)"""


#: share of the available memory the float32 weights may take under ``auto``; the rest is
#: for the KV cache, activations and the transient copy of each tensor while it is converted
FLOAT32_MEMORY_SHARE = 0.6


def resolve_cpu_weights(
    mode: CpuWeights, host: ComputeHost, float32_bytes: int
) -> tuple[CpuWeights, str]:
    """The concrete mode (never AUTO) and why, in words for the log."""
    if mode is not CpuWeights.AUTO:
        return mode, f"{mode} (asked for)"
    if not host.cpu_only:
        return CpuWeights.NATIVE, "native (mlx runs on an accelerator here)"
    if not host.optimized_blas:
        return CpuWeights.NATIVE, "native (no optimized BLAS: float32 would not be faster)"
    if host.available_bytes is not None:
        room = int(host.available_bytes * FLOAT32_MEMORY_SHARE)
        if float32_bytes > room:
            return CpuWeights.NATIVE, (
                f"native (float32 weights need {float32_bytes} bytes; "
                f"{room} of {host.available_bytes} available may go to weights)"
            )
    return CpuWeights.FLOAT32, "float32 (auto: CPU host with an optimized BLAS)"


def with_native_hint(error: ConfigurationError, mode: CpuWeights) -> ConfigurationError:
    """A plan that does not fit float32 weights also says the checkpoint's own may fit."""
    if mode is not CpuWeights.FLOAT32:
        return error
    return ConfigurationError(
        f"{error.message}; the stages hold float32 weights (4 bytes each): "
        "--cpu-weights native keeps the checkpoint's own, which may fit",
        source=error.source,
        key=error.key,
    )


_QUANT_KEYS = ("quantization", "quantization_config")
_DTYPE_KEYS = ("torch_dtype", "dtype")


def float32_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as a stage holding float32 weights sees it: unquantized, float32 tensors.

    The partitioner prices this to know what a float32 stage costs.
    """
    out = {k: v for k, v in config.items() if k not in _QUANT_KEYS}
    for key in _DTYPE_KEYS:
        out.pop(key, None)
    out["torch_dtype"] = "float32"
    text = config.get("text_config")
    if isinstance(text, Mapping):
        inner = {k: v for k, v in text.items() if k not in _QUANT_KEYS + _DTYPE_KEYS}
        inner["torch_dtype"] = "float32"
        out["text_config"] = inner
    return out


def held_config(config: Mapping[str, Any], mode: CpuWeights) -> Mapping[str, Any]:
    """The config whose profile prices what the stage holds in ``mode`` (not AUTO)."""
    if mode is CpuWeights.AUTO:
        raise ValueError("resolve auto first")
    return float32_config(config) if mode is CpuWeights.FLOAT32 else config
