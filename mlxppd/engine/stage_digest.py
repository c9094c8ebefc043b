"""The identity of what one stage serves: the model's config, family and quantization, and a
SHA-256 of exactly the checkpoint tensors its layer range owns (``core/stage_tensors.py``).

The digest is taken over the tensors' bytes as stored in the safetensors files (name, dtype,
shape and data, in name order), not over what the stage made of them in memory, so two nodes
holding the same checkpoint agree whatever weights mode each runs (native or float32), and a
node that holds only its own layers' files can still be checked. Only the safetensors header is
parsed (bounded); tensor data is hashed in 1 MiB reads.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.stage_tensors import owned_by
from mlxppd.core.stages import StageSpec

#: a safetensors header larger than this is refused (real ones are a few MiB at most)
MAX_HEADER_BYTES = 100 * 1024 * 1024
_CHUNK = 1 << 20


@dataclass(frozen=True)
class StageDigest:
    config_sha256: str
    family: str
    quantization: str
    """"none", or bits and group size, e.g. "4-bit/64" """
    tensors_sha256: str
    tensors: int
    nbytes: int
    """checkpoint bytes of the stage's tensors"""


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where the data starts, and the header's tensor entries (``__metadata__`` dropped)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigurationError("is not a safetensors file (too short)", source=str(path))
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER_BYTES:
            raise ConfigurationError(
                f"has a {size}-byte header, more than {MAX_HEADER_BYTES}", source=str(path)
            )
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise ConfigurationError("has a malformed header", source=str(path)) from None
    if not isinstance(header, dict):
        raise ConfigurationError("has a malformed header", source=str(path))
    header.pop("__metadata__", None)
    return 8 + size, header


def stage_digest(model_dir: Path, spec: StageSpec, config: dict[str, Any]) -> StageDigest:
    """The identity of stage ``spec`` of the checkpoint in ``model_dir``."""
    tied = bool(config.get("tie_word_embeddings", False))
    entries: list[tuple[str, Path, int, dict[str, Any]]] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        start, header = safetensors_header(path)
        entries += [(n, path, start, e) for n, e in header.items() if owned_by(n, spec, tied)]
    entries.sort(key=lambda e: e[0])
    digest, nbytes = hashlib.sha256(), 0
    for name, path, start, entry in entries:
        begin, end = (int(x) for x in entry["data_offsets"])
        digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode())
        with path.open("rb") as f:
            f.seek(start + begin)
            left = end - begin
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    raise ConfigurationError(f"ends inside tensor {name}", source=str(path))
                digest.update(chunk)
                left -= len(chunk)
        nbytes += end - begin
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    return StageDigest(
        config_sha256=hashlib.sha256(
            json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest(),
        family=str(config.get("model_type", "")),
        quantization=f"{bits}-bit/{quant.get('group_size')}" if bits else "none",
        tensors_sha256=digest.hexdigest(),
        tensors=len(entries),
        nbytes=nbytes,
    )
