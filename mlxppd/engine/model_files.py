"""A model directory in mlx-lm format: resolving it and loading some of its tensors.

Its config.json is read by ``mlxppd.core.profile.model.read_model_config``, the one reader.

Safetensors files are opened lazily by ``mx.load``: a tensor's bytes are read only when it is
evaluated, so a stage that keeps only its own tensors never reads the others from disk.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlxppd.core.errors import ConfigurationError
from mlxppd.engine.embedded import Progress, default_cache_dir, ensure_embedded_model

_INDEX_FILE = "model.safetensors.index.json"


def resolve_model_dir(
    model: str | None, cache_dir: Path | None = None, progress: Progress | None = None
) -> Path:
    """A local mlx-lm directory for ``--model``; None (the default) is the embedded model."""
    if model is None or model in ("", "embedded", "default"):
        return ensure_embedded_model(cache_dir or default_cache_dir(), progress)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigurationError(
                f"{path} has no config.json; point --model at an mlx-lm model directory",
                source="--model",
            )
        return path
    if path.exists():
        raise ConfigurationError(f"{path} is not a directory", source="--model")
    # A Hugging Face id needs a network; fetching goes through mlx-lm when one is there.
    from mlx_lm.utils import hf_repo_to_path

    try:
        resolved = hf_repo_to_path(model)
    except Exception as exc:
        raise ConfigurationError(
            f"{model!r} is neither a local directory nor a reachable Hugging Face model ({exc}); "
            "pass a local mlx-lm directory",
            source="--model",
        ) from exc
    return Path(resolved)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding the model's weights."""
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise ConfigurationError(
            "no model*.safetensors files; is this an mlx-lm model directory?",
            source=str(model_dir),
        )
    return files


def _files_for(model_dir: Path, wanted: Callable[[str], bool]) -> list[Path]:
    """Only the shards that hold a wanted tensor, when the directory has an index."""
    index = model_dir / _INDEX_FILE
    if not index.is_file():
        return weight_files(model_dir)
    weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
    names = sorted({f for key, f in weight_map.items() if wanted(key)})
    return [model_dir / n for n in names]


def load_tensors(model_dir: Path, wanted: Callable[[str], bool]) -> dict[str, mx.array]:
    """The tensors whose names ``wanted`` accepts, unevaluated (read from disk on eval)."""
    out: dict[str, mx.array] = {}
    for path in _files_for(model_dir, wanted):
        loaded = mx.load(str(path))
        assert isinstance(loaded, dict)
        out.update({k: v for k, v in loaded.items() if wanted(k)})
    return out
