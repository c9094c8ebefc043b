"""Float32 weights on CPU hosts: deciding ``auto`` for a stage and converting lazily at load.

The conversion is mlx-lm's own arithmetic (``dequantize_model`` then ``set_dtype``): a packed
matrix is dequantized to its scales' dtype, then every float tensor is cast to float32. It
works on the lazily opened checkpoint tensors, so a stage still reads only its own layers and
a repartition still keeps the tensors of the layers it retains (their names and dtypes match).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxppd.core.cpu_weights import ComputeHost, CpuWeights, float32_config, resolve_cpu_weights
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.profile.model import profile_from_config
from mlxppd.core.stages import StageSpec
from mlxppd.engine.blas import blas_in_use

QuantParams = Callable[[str, nn.Module], "dict[str, Any] | bool"]


def available_memory_bytes(
    proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Memory the kernel can give this process now, or None when nothing says.

    On Linux: MemAvailable, or (where /proc/meminfo is hidden, e.g. under systemd's
    ``ProcSubset=pid``) the free pages; either capped by the room left under this process's
    cgroup v2 ``memory.max`` (a unit's ``MemoryMax=``), which MemAvailable does not see.
    """
    if sys.platform != "linux":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    host = _meminfo_available(proc / "meminfo")
    if host is None:
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            host = None
    room = _cgroup_room(proc / "self" / "cgroup", cgroups)
    known = [n for n in (host, room) if n is not None]
    return min(known) if known else None


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(self_cgroup: Path, cgroups: Path) -> int | None:
    """``memory.max - memory.current`` of this process's cgroup v2, or None (no limit)."""
    try:
        for line in self_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                group = cgroups / line[3:].lstrip("/")
                limit = (group / "memory.max").read_text().strip()
                if limit == "max":
                    return None
                return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError):
        return None
    return None


def compute_host() -> ComputeHost:
    """This process's facts for ``auto``."""
    accelerated = mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())
    return ComputeHost(
        cpu_only=not accelerated or mx.default_device() == mx.cpu,
        optimized_blas=blas_in_use().optimized,
        available_bytes=available_memory_bytes(),
    )


def stage_float32_bytes(config: dict[str, Any], spec: StageSpec) -> int:
    """What the stage's weights take in float32 (the partitioner's pricing)."""
    profile = profile_from_config(float32_config(config))
    layers = LayerRange(spec.start, spec.end)
    return profile.stage_bytes(layers, first=spec.has_embedding, last=spec.has_lm_head)


def resolve_for_stage(
    mode: CpuWeights, config: dict[str, Any], spec: StageSpec, host: ComputeHost | None = None
) -> tuple[CpuWeights, str]:
    """The concrete weight mode of one stage on this host, and why."""
    if mode is not CpuWeights.AUTO:
        return mode, f"{mode} (asked for)"
    return resolve_cpu_weights(mode, host or compute_host(), stage_float32_bytes(config, spec))


def resolve_for_process(
    mode: CpuWeights, config: dict[str, Any], host: ComputeHost | None = None
) -> tuple[CpuWeights, str]:
    """The concrete weight mode when this process holds every layer (generate, in-process)."""
    if mode is not CpuWeights.AUTO:
        return mode, f"{mode} (asked for)"
    total = profile_from_config(float32_config(config)).total_bytes
    return resolve_cpu_weights(mode, host or compute_host(), total)


def float32_weights(
    model: nn.Module, weights: dict[str, mx.array], quant_params: QuantParams
) -> dict[str, mx.array]:
    """``weights`` with every packed matrix the model would quantize dequantized, and every float
    tensor cast to float32; still lazy. ``quant_params(path, module)`` is the loader's rule."""
    out = dict(weights)
    for path, module in model.named_modules():
        params = quant_params(path, module)
        if not isinstance(params, dict):
            continue
        out[f"{path}.weight"] = mx.dequantize(
            out[f"{path}.weight"],
            out.pop(f"{path}.scales"),
            out.pop(f"{path}.biases", None),
            group_size=params["group_size"],
            bits=params["bits"],
            mode=params.get("mode", "affine"),
        )
    return {
        name: value.astype(mx.float32) if mx.issubdtype(value.dtype, mx.floating) else value
        for name, value in out.items()
    }
