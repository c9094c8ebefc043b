"""Reading an adapter directory: its config, and only the tensors one stage runs.

The safetensors file is opened lazily (``mx.load``): the tensors a stage does not run are
never evaluated, so never read. The stage's adapter digest covers the config and exactly the
tensors it read (their stored bytes), so two copies of an adapter are compared the way the
model's own tensors are (``core/model_identity.py``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from mlxppd.core.adapters import CONFIG_FILE, AdapterConfig, adapter_config, tensor_name
from mlxppd.core.errors import ConfigurationError
from mlxppd.engine.stage_digest import hash_range, safetensors_header

__all__ = ["AdapterWeights", "adapter_digest", "read_adapter", "read_adapter_config"]

#: an adapter config file larger than this is refused (real ones are a few hundred bytes)
_MAX_CONFIG_BYTES = 1 << 20


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


def read_adapter_config(path: Path) -> AdapterConfig:
    """The config of the adapter directory ``path``; a sentence naming the file on error."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigurationError(
            "is not a directory; point --adapter at the directory mlx_lm lora --adapter-path "
            "wrote (adapter_config.json and adapters.safetensors)",
            source=str(path),
        )
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise ConfigurationError(f"has no {CONFIG_FILE}", source=str(path))
    if config_file.stat().st_size > _MAX_CONFIG_BYTES:
        raise ConfigurationError("is larger than 1 MiB", source=str(config_file))
    try:
        data = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ConfigurationError(f"is not JSON ({exc})", source=str(config_file)) from None
    files = {p.name for p in path.iterdir()}
    return adapter_config(data, files, str(config_file))


def _digest_start(config: AdapterConfig) -> hashlib._Hash:
    digest = hashlib.sha256()
    digest.update(
        json.dumps([config.kind, config.rank, config.scale, config.naming]).encode() + b"\n"
    )
    return digest


def adapter_digest(path: Path, wanted: Callable[[str], bool]) -> tuple[str, int]:
    """The digest of the adapter tensors whose module ``wanted`` accepts (and how many), from
    the stored bytes alone: what :func:`read_adapter` reports, without loading anything."""
    config = read_adapter_config(path)
    file = Path(path).expanduser() / config.weights_file
    start, header = safetensors_header(file)
    digest = _digest_start(config)
    count = 0
    for name in sorted(header):
        where = tensor_name(name, config.naming)
        if where is None or not wanted(where.module):
            continue
        begin, end = (int(x) for x in header[name]["data_offsets"])
        tensor_sha = hash_range(file, start + begin, end - begin).hexdigest()
        entry = [name, header[name]["dtype"], header[name]["shape"], tensor_sha]
        digest.update(json.dumps(entry).encode() + b"\n")
        count += 1
    return digest.hexdigest(), count


def read_adapter(path: Path, wanted: Callable[[str], bool]) -> AdapterWeights:
    """The tensors of adapter directory ``path`` whose module ``wanted`` accepts, evaluated;
    the others are never read."""
    path = Path(path).expanduser()
    config = read_adapter_config(path)
    file = path / config.weights_file
    _, header = safetensors_header(file)
    names = {n: tensor_name(n, config.naming) for n in header}
    strange = sorted(n for n, where in names.items() if where is None)
    if strange:
        raise ConfigurationError(
            f"holds {len(strange)} tensors that are not LoRA weights (first: {strange[0]}); "
            "only LoRA and DoRA adapters are served",
            source=str(file),
        )
    lazy = mx.load(str(file))
    assert isinstance(lazy, dict)
    out = AdapterWeights(path, config, stored=len(names))
    for name, where in sorted(names.items()):
        assert where is not None
        if not wanted(where.module):
            continue
        tensor = lazy[name]
        out.modules.setdefault(where.module, {})[where.leaf] = (
            tensor.T if where.transpose else tensor
        )
        out.read += 1
    mx.eval([t for leaves in out.modules.values() for t in leaves.values()])
    out.digest = adapter_digest(path, wanted)[0]
    for module, leaves in out.modules.items():
        if "lora_a" not in leaves or "lora_b" not in leaves:
            raise ConfigurationError(
                f"has no {'lora_a' if 'lora_a' not in leaves else 'lora_b'} for {module}",
                source=str(file),
            )
    return out
