"""The model directory's small non-weight files in a prepared copy (``MODEL_FILES``: the
tokenizer, its templates, generation defaults), beside config.json.

A stage whose copy came from ``mlxppctl prepare`` has only what was shipped, so without these
its tokenizer cannot load and the last stage cannot compile output grammars. They travel after
the tensors in the same stream, and are verified by SHA-256 like them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.protocol.model_transfer import (
    MAX_MODEL_FILE_BYTES,
    MAX_MODEL_FILES_BYTES,
    MODEL_FILES,
    FileRecord,
)

_CHUNK = 1 << 20


@dataclass(frozen=True)
class HeldFile:
    """A model file's record and where it lies."""

    record: FileRecord
    path: Path


def sha256_of(path: Path, offset: int = 0, nbytes: int | None = None) -> str:
    """The SHA-256 of ``nbytes`` of ``path`` from ``offset`` (to its end when None)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        left = nbytes
        while left is None or left > 0:
            chunk = f.read(_CHUNK if left is None else min(_CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
    return digest.hexdigest()


def model_files_of(source: Path) -> dict[str, HeldFile]:
    """The ``MODEL_FILES`` that ``source`` holds, each hashed; one over the bounds is refused
    with a sentence (shipping a stage without it would leave it no tokenizer, silently)."""
    held: dict[str, HeldFile] = {}
    for name in MODEL_FILES:
        path = source / name
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size > MAX_MODEL_FILE_BYTES:
            raise ConfigurationError(
                f"{name} is {size} bytes; a prepared copy carries at most "
                f"{MAX_MODEL_FILE_BYTES >> 20} MiB of each model file",
                source=str(path),
            )
        held[name] = HeldFile(FileRecord(name=name, nbytes=size, sha256=sha256_of(path)), path)
    total = sum(h.record.nbytes for h in held.values())
    if total > MAX_MODEL_FILES_BYTES:
        raise ConfigurationError(
            f"its model files are {total} bytes in all; a prepared copy carries at most "
            f"{MAX_MODEL_FILES_BYTES >> 20} MiB of them",
            source=str(source),
        )
    return held


def find_local(
    record: FileRecord, sources: Iterable[Path | None]
) -> tuple[Literal["present", "missing", "mismatch"], Path | None]:
    """Whether a directory of ``sources`` holds ``record`` as listed (and which), or one with
    that name differs, or none holds it. The name was checked against ``MODEL_FILES``."""
    found: Literal["missing", "mismatch"] = "missing"
    for source in sources:
        if source is None:
            continue
        path = source / record.name
        try:
            if not path.is_file():
                continue
            if path.stat().st_size == record.nbytes and sha256_of(path) == record.sha256:
                return "present", path
        except OSError:
            continue
        found = "mismatch"
    return found, None


class ShortSource(OSError):
    """A file ended before the bytes a copy was told it holds."""


def copy_range(source: Path, offset: int, nbytes: int, out: BinaryIO) -> None:
    """Append ``nbytes`` of ``source`` from ``offset`` to ``out``, a piece at a time."""
    with source.open("rb") as f:
        f.seek(offset)
        left = nbytes
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise ShortSource(f"{source} ends {left} bytes before the {nbytes} to copy")
            out.write(chunk)
            left -= len(chunk)


def copy_bytes(source: Path, offset: int, nbytes: int, target: Path) -> None:
    """``nbytes`` of ``source`` from ``offset`` as the whole of ``target``, synced."""
    with target.open("wb") as out:
        copy_range(source, offset, nbytes, out)
        out.flush()
        os.fsync(out.fileno())
