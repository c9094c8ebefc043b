"""A stage's adapters: the fused one it loaded with, and the per-request ones it holds now."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.nn as nn

from mlxppd.core.adapters import wanted_by
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.stages import StageSpec
from mlxppd.engine.adapters.modules import Selection, add_named, fuse_adapter, remove_named
from mlxppd.engine.adapters.reader import read_adapter

__all__ = ["AdapterInfo", "StageAdapters", "ensure_no_adapter"]


@dataclass(frozen=True)
class AdapterInfo:
    """What a stage holds of one adapter (the status document and the identity show it)."""

    name: str | None
    """None: the fused adapter"""
    path: str
    kind: str
    digest: str
    read: int
    """tensors this stage read (its layers' only)"""
    stored: int
    """adapter tensors in the file"""
    modules: int


def ensure_no_adapter(family: Any, config: dict[str, Any]) -> None:
    """Refuse, in one sentence naming the family, a model whose stages cannot take adapters."""
    why = getattr(family, "ADAPTER_REFUSAL", None)
    if why:
        raise ConfigurationError(
            f"model_type {config.get('model_type')!r} cannot run LoRA adapters: {why}",
            source="--adapter",
        )


@dataclass
class StageAdapters:
    """The adapters of one stage's model."""

    model: nn.Module
    spec: StageSpec | None
    """None: the whole model in one process"""
    family: str
    tied: bool
    selection: Selection = field(default_factory=Selection)
    fused: AdapterInfo | None = None
    named: dict[str, AdapterInfo] = field(default_factory=dict)

    def _wanted(self, module: str) -> bool:
        return wanted_by(module, self.spec, self.tied)

    def fuse(self, path: Path) -> AdapterInfo:
        weights = read_adapter(path, self._wanted)
        modules = fuse_adapter(self.model, weights, self.family)
        self.fused = AdapterInfo(
            None, str(path), weights.config.kind, weights.digest, weights.read, weights.stored,
            modules,
        )  # fmt: skip
        return self.fused

    def load(self, name: str, path: Path) -> AdapterInfo:
        """Hold adapter ``name`` for the requests that choose it (replacing one of that name)."""
        weights = read_adapter(path, self._wanted)
        modules = add_named(
            self.model, name, weights, self.family, self.selection, replace=name in self.named
        )
        info = AdapterInfo(
            name, str(path), weights.config.kind, weights.digest, weights.read, weights.stored,
            modules,
        )  # fmt: skip
        self.named[name] = info
        return info

    def unload(self, name: str) -> bool:
        if self.named.pop(name, None) is None:
            return False
        remove_named(self.model, name)
        return True

    def select(self, rows: Sequence[str | None]) -> None:
        """The adapter each row of the next forward pass runs."""
        self.selection.rows = tuple(rows)

    def digests(self) -> Mapping[str, str]:
        """Adapter digests by name ("" for the fused one): what a stage's identity carries."""
        out = {info.name or "": info.digest for info in self.named.values()}
        if self.fused is not None:
            out[""] = self.fused.digest
        return dict(sorted(out.items()))


def attach_adapters(
    model: nn.Module,
    spec: StageSpec | None,
    config: dict[str, Any],
    family: Any,
    fused: Path | None = None,
    named: Mapping[str, Path] | None = None,
) -> StageAdapters:
    """The stage's adapters: ``fused`` into its weights, then each of ``named`` beside them."""
    adapters = StageAdapters(
        model, spec, str(config.get("model_type", "?")),
        tied=bool(config.get("tie_word_embeddings", False)),
    )  # fmt: skip
    if fused is not None or named:
        ensure_no_adapter(family, config)
    if fused is not None:
        adapters.fuse(fused)
    for name, path in (named or {}).items():
        adapters.load(name, path)
    return adapters
