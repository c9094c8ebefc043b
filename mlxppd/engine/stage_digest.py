"""The identity of what one stage serves, read from the files: a :class:`TensorRecord` (SHA-256
of the stored bytes) per checkpoint tensor, and the stage's identity over exactly the tensors
its layer range owns (``core/model_identity.py``, ``core/stage_tensors.py``).

Digests are taken over the bytes as stored in the safetensors files, not over what a stage made
of them in memory, so two nodes holding the same checkpoint agree whatever weights mode each
runs. Only the safetensors header is parsed (bounded); tensor data is hashed in 1 MiB reads.
Hashing a large model takes a while, so each file's records are cached in the model cache,
keyed by the file's device, inode, size and modification time: a file changed in any way the
filesystem notices is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.model_identity import StageIdentity, TensorRecord, identity_of
from mlxppd.core.stage_tensors import owned_by
from mlxppd.core.stages import StageSpec

#: a safetensors header larger than this is refused (real ones are a few MiB at most)
MAX_HEADER_BYTES = 100 * 1024 * 1024
_CHUNK = 1 << 20
_CACHE_VERSION = 1


@dataclass(frozen=True)
class StoredTensor:
    """A tensor's record and where its bytes are."""

    record: TensorRecord
    path: Path
    offset: int
    """absolute offset of its first byte in ``path``"""


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where the data starts, and the header's tensor entries (``__metadata__`` dropped)."""
    with path.open("rb") as f:
        return read_safetensors_header(f, os.fstat(f.fileno()).st_size, str(path))


def read_safetensors_header(f: BinaryIO, size: int, source: str) -> tuple[int, dict[str, Any]]:
    """``safetensors_header`` of the open file ``f`` of ``size`` bytes; ``source`` names it.

    Every entry is checked (dtype, shape, data inside the file), so a caller reads fields
    without a KeyError. Errors never quote the file's bytes: a file that is not safetensors
    (a key, a log) must not have its first bytes echoed back as a "header length".
    """
    not_safetensors = "is not a safetensors file"
    f.seek(0)
    raw = f.read(8)
    if len(raw) != 8:
        raise ConfigurationError(f"{not_safetensors} (too short)", source=source)
    (length,) = struct.unpack("<Q", raw)
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise ConfigurationError(
            f"{not_safetensors} (its header length is past the end of the file or over "
            f"{MAX_HEADER_BYTES >> 20} MiB)",
            source=source,
        )
    try:
        header = json.loads(f.read(length))
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than json allows
        raise ConfigurationError(
            f"{not_safetensors} (its header is not JSON)", source=source
        ) from None
    if not isinstance(header, dict):
        raise ConfigurationError(f"{not_safetensors} (its header is not an object)", source=source)
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    for index, entry in enumerate(header.values()):
        if not _valid_entry(entry, data_bytes):
            raise ConfigurationError(
                f"{not_safetensors} (entry {index} of its header is not a tensor with a dtype, "
                "a shape and data_offsets inside the file)",
                source=source,
            )
    return 8 + length, header


def _valid_entry(entry: Any, data_bytes: int) -> bool:
    if not isinstance(entry, dict):
        return False
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    return (
        isinstance(dtype, str)
        and 0 < len(dtype) <= 16
        and isinstance(shape, list)
        and all(type(d) is int and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(x) is int for x in offsets)
        and 0 <= offsets[0] <= offsets[1] <= data_bytes
    )


def hash_range(path: Path, offset: int, length: int, digest: Any = None) -> Any:
    """SHA-256 (or ``digest`` updated) over ``length`` bytes of ``path`` from ``offset``."""
    with path.open("rb") as f:
        return hash_file_range(f, offset, length, digest, str(path))


def hash_file_range(
    f: BinaryIO, offset: int, length: int, digest: Any = None, source: str = ""
) -> Any:
    """``hash_range`` over the open file ``f``."""
    digest = digest if digest is not None else hashlib.sha256()
    f.seek(offset)
    left = length
    while left > 0:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            raise ConfigurationError(f"ends {left} bytes early", source=source or None)
        digest.update(chunk)
        left -= len(chunk)
    return digest


def _cache_file(cache_dir: Path, path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return cache_dir / "digests" / f"{key}.json"


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [_CACHE_VERSION, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _cached(cache_dir: Path | None, path: Path) -> dict[str, str] | None:
    if cache_dir is None:
        return None
    try:
        data = json.loads(_cache_file(cache_dir, path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("stamp") != _stamp(path):
        return None
    sums = data.get("sha256")
    return sums if isinstance(sums, dict) else None


def _remember(cache_dir: Path | None, path: Path, stamp: list[int], sums: dict[str, str]) -> None:
    if cache_dir is None:
        return
    target = _cache_file(cache_dir, path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": str(path), "stamp": stamp, "sha256": sums}))
        os.replace(tmp, target)
    except OSError:
        pass  # a read-only cache only costs the next start a rehash


def weight_files_of(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def stored_tensors(
    model_dir: Path, wanted: Callable[[str], bool], cache_dir: Path | None = None
) -> dict[str, StoredTensor]:
    """Every wanted tensor of the directory's safetensors files, with its record."""
    out: dict[str, StoredTensor] = {}
    for path in weight_files_of(model_dir):
        stamp = _stamp(path)
        start, header = safetensors_header(path)
        entries = {n: e for n, e in header.items() if wanted(n)}
        if not entries:
            continue
        sums = _cached(cache_dir, path) or {}
        fresh = not all(n in sums for n in entries)
        if fresh:
            sums = {
                n: hash_range(path, start + int(e["data_offsets"][0]), _size(e)).hexdigest()
                for n, e in sorted(header.items(), key=lambda item: _begin(item[1]))
            }
            _remember(cache_dir, path, stamp, sums)
        for name, entry in entries.items():
            record = TensorRecord(
                name=name,
                dtype=str(entry["dtype"]),
                shape=[int(d) for d in entry["shape"]],
                nbytes=_size(entry),
                sha256=sums[name],
            )
            out[name] = StoredTensor(record, path, start + _begin(entry))
    return out


def _begin(entry: Any) -> int:
    return int(entry["data_offsets"][0])


def _size(entry: Any) -> int:
    begin, end = (int(x) for x in entry["data_offsets"])
    if end < begin:
        raise ConfigurationError("has a tensor whose data ends before it begins")
    return end - begin


def stage_wanted(spec: StageSpec, config: dict[str, Any]) -> Callable[[str], bool]:
    tied = bool(config.get("tie_word_embeddings", False))
    return lambda name: owned_by(name, spec, tied)


def stage_tensors_of(
    model_dir: Path, spec: StageSpec, config: dict[str, Any], cache_dir: Path | None = None
) -> dict[str, StoredTensor]:
    """The stored tensors stage ``spec`` owns in ``model_dir``."""
    return stored_tensors(model_dir, stage_wanted(spec, config), cache_dir)


def stage_identity(
    model_dir: Path, spec: StageSpec, config: dict[str, Any], cache_dir: Path | None = None
) -> StageIdentity:
    """The identity of stage ``spec`` of the checkpoint in ``model_dir``."""
    tensors = stage_tensors_of(model_dir, spec, config, cache_dir)
    return identity_of((t.record for t in tensors.values()), config, (spec.start, spec.end))


def iter_chunks(tensor: StoredTensor, skip: int = 0, size: int = _CHUNK) -> Iterator[bytes]:
    """The tensor's stored bytes from ``skip`` on, ``size`` at a time."""
    with tensor.path.open("rb") as f:
        f.seek(tensor.offset + skip)
        left = tensor.record.nbytes - skip
        while left > 0:
            chunk = f.read(min(size, left))
            if not chunk:
                raise ConfigurationError("ends inside a tensor", source=str(tensor.path))
            yield chunk
            left -= len(chunk)
