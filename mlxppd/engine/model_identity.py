"""A model directory's identity, compared by zero-config peers before they accept a stage."""

from __future__ import annotations

import hashlib
from pathlib import Path

from mlxppd.core.profile.model import read_model_config
from mlxppd.core.protocol.assignment import ModelIdentity
from mlxppd.engine.families import family_for


def model_identity(model_dir: Path) -> ModelIdentity:
    """config.json's hash, the weight files' names and sizes, and the layer count."""
    config = read_model_config(model_dir)
    files = sorted(
        (p.name, p.stat().st_size) for p in model_dir.iterdir() if p.suffix == ".safetensors"
    )
    return ModelIdentity(
        config_sha256=hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        files=files,
        num_layers=family_for(config).num_layers(config),
    )
