"""Where this host's copy of the model is: the configured directory, the prepared copy that
``mlxppctl prepare`` shipped (``engine/prepared_copy.py``), or nowhere yet.

Read again on every configuration load, so a prepared copy that arrives is served from the next
reconcile on (the stage worker restarts on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.profile.model import read_model_config
from mlxppd.engine.model_files import resolve_model_dir
from mlxppd.engine.prepared_copy import has_model, prepared_root


@dataclass(frozen=True)
class ModelPlace:
    """This host's copies of the model."""

    configured: Path | None
    """the directory mlxppd.toml's ``model`` names (or the embedded model's); None when it
    does not exist on this host"""
    root: Path
    """where prepared copies of this model go"""
    cache_dir: Path
    """the model cache (digests are cached there too)"""
    config: dict[str, Any] | None
    """config.json from the configured directory, else from the prepared copy; None: neither"""

    @property
    def source(self) -> Path | None:
        """Where a coordinator's tokenizer and the cluster's copy come from."""
        if has_model(self.configured):
            return self.configured
        current = self.root / "current"
        return current if has_model(current) else None


def _looks_like_path(model: str) -> bool:
    """A local path rather than a Hugging Face id ("org/name")."""
    return model.startswith(("/", ".", "~")) or model.count("/") >= 2


def locate_model(model: str | None, cache_dir: Path, known: Path | None = None) -> ModelPlace:
    """This host's copies of ``model`` (None: the embedded one). ``known``: the configured
    directory already resolved by an earlier load (the embedded model is converted once)."""
    configured: Path | None = known
    if configured is None:
        path = Path(model).expanduser() if model else None
        if path is not None and not path.exists() and _looks_like_path(model or ""):
            configured = None  # a path this host lacks: prepare may ship it
        else:
            configured = resolve_model_dir(model, cache_dir=cache_dir)
    name = configured.name if configured is not None else Path(model or "model").name
    root = prepared_root(cache_dir, name)
    place = ModelPlace(configured, root, cache_dir, None)
    source = place.source
    if source is None:
        return place
    try:
        config = read_model_config(source)
    except ConfigurationError:
        if source == configured:
            raise
        return place
    return ModelPlace(configured, root, cache_dir, config)
