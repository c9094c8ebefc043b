"""Memory sizes for ``--stage-memory``: parsing "64GiB,16GiB" and printing bytes back."""

from __future__ import annotations

import re

from mlxppd.core.errors import ConfigurationError

__all__ = ["format_bytes", "parse_byte_size", "parse_stage_memory"]

_STAGE_MEMORY = "--stage-memory"

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_byte_size(text: str, source: str = _STAGE_MEMORY) -> int:
    """Bytes in "64GiB", "16 GB", "512MiB", "1.5G" or "1073741824".

    GB / MB are decimal (10^9), GiB / MiB and the bare letters G / M binary (2^30).
    """
    match = _SIZE_RE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigurationError(
            f"{text.strip()!r} is not a memory size; write a number with a unit such as "
            "64GiB, 16GB, 512MiB, or plain bytes",
            source=source,
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigurationError(f"{text.strip()!r} is not a positive size", source=source)
    return value


def parse_stage_memory(text: str, num_stages: int) -> tuple[int, ...]:
    """Per-stage budgets from "64GiB,16GiB"; one value applies to every stage."""
    parts = [p for p in text.split(",")]
    if any(not p.strip() for p in parts):
        raise ConfigurationError(
            f"{text!r} has an empty entry; give one size per stage, like '64GiB,16GiB'",
            source=_STAGE_MEMORY,
        )
    sizes = tuple(parse_byte_size(p) for p in parts)
    if len(sizes) == 1:
        return sizes * num_stages
    if len(sizes) != num_stages:
        raise ConfigurationError(
            f"gives {len(sizes)} sizes for {num_stages} stages; give one size per stage "
            "(or a single size for all of them)",
            source=_STAGE_MEMORY,
        )
    return sizes


def format_bytes(n: int) -> str:
    """'54.6 MiB', '1.20 GiB': binary units, like the budgets operators write."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    return f"{n} B"
