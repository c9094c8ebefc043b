"""Reading an adapter directory: its config, and only the tensors one stage runs.

Both files are opened without following a symbolic link and checked on the opened descriptor
(a regular file, within size bounds: ``core/config/private_file.py``'s ``open_regular_file``),
and everything is then read through that descriptor, mlx included, so what was checked is what
is read. An adapter path comes from an operator's request: a link to a key file must not be
read, and no error quotes a file's bytes (the path is escaped).

The safetensors file is opened lazily (``mx.load``): the tensors a stage does not run are
never evaluated, so never read. The stage's adapter digest covers the config and exactly the
tensors it read (their stored bytes), so two copies of an adapter are compared the way the
model's own tensors are (``core/model_identity.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx

from mlxppd.core.adapters import CONFIG_FILE, AdapterConfig, adapter_config, tensor_name
from mlxppd.core.config.private_file import FileRefused, open_regular_file
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.log_text import escape, quoted
from mlxppd.engine.stage_digest import hash_file_range, read_safetensors_header

__all__ = ["AdapterWeights", "adapter_digest", "read_adapter", "read_adapter_config"]

#: an adapter config file larger than this is refused (real ones are a few hundred bytes)
_MAX_CONFIG_BYTES = 1 << 20
#: an adapter weights file larger than this is refused (a rank-64 adapter of a 70B is ~1 GiB)
MAX_ADAPTER_BYTES = 64 << 30


@dataclass
class AdapterWeights:
    """The part of one adapter a stage runs."""

    path: Path
    config: AdapterConfig
    modules: dict[str, dict[str, mx.array]] = field(default_factory=dict)
    """module path -> {"lora_a", "lora_b"[, "m"]}, in mlx-lm's orientation"""
    read: int = 0
    """tensors read from the file"""
    stored: int = 0
    """adapter tensors in the file"""
    digest: str = ""
    """SHA-256 over the config and the stored bytes of the tensors read"""


@contextmanager
def _adapter_file(path: Path, max_bytes: int) -> Iterator[tuple[BinaryIO, int]]:
    """``path`` opened as :func:`open_regular_file` opens it, and its size; errors name it."""
    where = escape(str(path))
    try:
        fd, st = open_regular_file(path, max_bytes=max_bytes)
    except FileRefused as exc:
        why = {
            "symlink": "is a symbolic link, and adapter files are opened without following "
            "links; copy the file itself into the adapter directory (`cp -L`)",
            "not_regular": "is not a regular file",
            "too_large": f"is larger than {max_bytes >> 20} MiB",
        }[exc.kind]
        raise ConfigurationError(why, source=where) from None
    except OSError as exc:
        raise ConfigurationError(
            f"cannot be read ({exc.strerror or 'error'})", source=where
        ) from None
    with os.fdopen(fd, "rb") as f:
        yield f, st.st_size


def _fd_path(f: BinaryIO) -> str:
    """A path that opens the file ``f`` has open (not whatever the name points at now)."""
    base = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    return f"{base}/{f.fileno()}"


def read_adapter_config(path: Path) -> AdapterConfig:
    """The config of the adapter directory ``path``; a sentence naming the file on error."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigurationError(
            "is not a directory; point --adapter at the directory mlx_lm lora --adapter-path "
            "wrote (adapter_config.json and adapters.safetensors)",
            source=escape(str(path)),
        )
    config_file = path / CONFIG_FILE
    where = escape(str(config_file))
    if not config_file.exists() and not config_file.is_symlink():
        raise ConfigurationError(f"has no {CONFIG_FILE}", source=escape(str(path)))
    with _adapter_file(config_file, _MAX_CONFIG_BYTES) as (f, _):
        raw = f.read(_MAX_CONFIG_BYTES + 1)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigurationError("is not UTF-8 text", source=where) from None
    except json.JSONDecodeError as exc:  # its position, never the text around it
        raise ConfigurationError(
            f"is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})", source=where
        ) from None
    except (ValueError, RecursionError):
        raise ConfigurationError("is not JSON", source=where) from None
    files = {p.name for p in path.iterdir()}
    return adapter_config(data, files, where)


def _digest_start(config: AdapterConfig) -> hashlib._Hash:
    digest = hashlib.sha256()
    digest.update(
        json.dumps([config.kind, config.rank, config.scale, config.naming]).encode() + b"\n"
    )
    return digest


def _digest(
    f: BinaryIO,
    start: int,
    header: dict[str, Any],
    config: AdapterConfig,
    wanted: Callable[[str], bool],
) -> tuple[str, int]:
    digest = _digest_start(config)
    count = 0
    for name in sorted(header):
        where = tensor_name(name, config.naming)
        if where is None or not wanted(where.module):
            continue
        begin, end = (int(x) for x in header[name]["data_offsets"])
        tensor_sha = hash_file_range(f, start + begin, end - begin).hexdigest()
        entry = [name, header[name]["dtype"], header[name]["shape"], tensor_sha]
        digest.update(json.dumps(entry).encode() + b"\n")
        count += 1
    return digest.hexdigest(), count


def adapter_digest(path: Path, wanted: Callable[[str], bool]) -> tuple[str, int]:
    """The digest of the adapter tensors whose module ``wanted`` accepts (and how many), from
    the stored bytes alone: what :func:`read_adapter` reports, without loading anything."""
    path = Path(path).expanduser()
    config = read_adapter_config(path)
    file = path / config.weights_file
    with _adapter_file(file, MAX_ADAPTER_BYTES) as (f, size):
        start, header = read_safetensors_header(f, size, escape(str(file)))
        return _digest(f, start, header, config, wanted)


def read_adapter(path: Path, wanted: Callable[[str], bool]) -> AdapterWeights:
    """The tensors of adapter directory ``path`` whose module ``wanted`` accepts, evaluated;
    the others are never read."""
    path = Path(path).expanduser()
    config = read_adapter_config(path)
    file = path / config.weights_file
    where = escape(str(file))
    with _adapter_file(file, MAX_ADAPTER_BYTES) as (f, size):
        start, header = read_safetensors_header(f, size, where)
        names = {n: tensor_name(n, config.naming) for n in header}
        strange = sorted(n for n, place in names.items() if place is None)
        if strange:
            raise ConfigurationError(
                f"holds {len(strange)} tensors that are not LoRA weights (first: "
                f"{quoted(strange[0], 80)}); only LoRA and DoRA adapters are served",
                source=where,
            )
        try:
            lazy = mx.load(_fd_path(f), format="safetensors")
        except (ValueError, RuntimeError):
            raise ConfigurationError(
                "is not a safetensors file mlx can load", source=where
            ) from None
        assert isinstance(lazy, dict)
        out = AdapterWeights(path, config, stored=len(names))
        for name, place in sorted(names.items()):
            assert place is not None
            if not wanted(place.module):
                continue
            tensor = lazy[name]
            out.modules.setdefault(place.module, {})[place.leaf] = (
                tensor.T if place.transpose else tensor
            )
            out.read += 1
        mx.eval([t for leaves in out.modules.values() for t in leaves.values()])
        out.digest = _digest(f, start, header, config, wanted)[0]
    for module, leaves in out.modules.items():
        if "lora_a" not in leaves or "lora_b" not in leaves:
            missing = "lora_a" if "lora_a" not in leaves else "lora_b"
            raise ConfigurationError(f"has no {missing} for {quoted(module, 120)}", source=where)
    return out
