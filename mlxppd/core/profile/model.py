"""ModelProfile: what each block of a model weighs, read from ``config.json`` alone.

No weights are needed, so a user can plan a model before downloading it. Every tensor is named
and sized the way mlx-lm's model class holds it (see ``profile.pricing`` and the family layouts),
so the per-block bytes are those of the loaded parameters, quantization scales and biases
included. The two ends of the pipeline carry extra tables: stage 0 the token embedding (and,
for Gemma 4, the per-layer input tables it computes for every block), the last stage the final
norm and the output head, which with tied embeddings is the embedding table again.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import AdjacencyGroup, LayerRange
from mlxppd.core.profile.builders import dense_fallback
from mlxppd.core.profile.families import FAMILIES
from mlxppd.core.profile.pricing import (
    Layout,
    Pricer,
    dtype_bytes_from_config,
    quantization_from_config,
)

__all__ = [
    "ModelConfig",
    "ModelProfile",
    "profile_from_config",
    "profile_tensors",
    "profiled_model_types",
    "read_model_config",
]

#: a model's config.json as read: free-form JSON, whose keys vary by family (engine/families/)
ModelConfig = dict[str, Any]


def profiled_model_types() -> tuple[str, ...]:
    """The model types priced by a dedicated layout (others fall back to llama-like blocks)."""
    return tuple(sorted(FAMILIES))


@dataclass(frozen=True)
class ModelProfile:
    """Per-block parameter bytes and placement constraints of one model."""

    model_type: str
    #: wire family name (``llama``, ``gemma4``, ...) or a description of the fallback used
    family: str
    #: bytes of every block, in layer order, as loaded (quantized tensors packed)
    layer_bytes: tuple[int, ...]
    #: what each block is ("attention+moe", "mamba+mlp", "mla+mlp", ...)
    layer_kinds: tuple[str, ...]
    #: what stage 0 holds besides its blocks
    embedding_bytes: int
    #: what the last stage holds besides its blocks (with tied embeddings: the table again)
    lm_head_bytes: int
    #: bytes counted in both ends that one stage holding both ends keeps once (the tied table)
    shared_end_bytes: int = 0
    adjacency_groups: tuple[AdjacencyGroup, ...] = ()
    #: why this model cannot run as pipeline stages (None: it can)
    pipeline_refusal: str | None = None
    #: caveats about the estimate (fallback pricing, unknown quantization method)
    notes: tuple[str, ...] = ()
    #: how the weights are stored, in words ("4-bit affine, group size 64")
    storage: str = ""

    def __post_init__(self) -> None:
        if not self.layer_bytes:
            raise ValueError("a model profile needs at least one layer")
        if len(self.layer_kinds) != len(self.layer_bytes):
            raise ValueError("layer_kinds and layer_bytes differ in length")
        if min(self.layer_bytes) < 0 or self.embedding_bytes < 0 or self.lm_head_bytes < 0:
            raise ValueError("byte counts cannot be negative")
        for group in self.adjacency_groups:
            if group.last >= len(self.layer_bytes):
                raise ValueError(f"adjacency group {group} passes the last layer")

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def total_bytes(self) -> int:
        """The whole model in one process."""
        return (
            sum(self.layer_bytes)
            + self.embedding_bytes
            + self.lm_head_bytes
            - self.shared_end_bytes
        )

    def stage_bytes(self, layers: LayerRange, *, first: bool, last: bool) -> int:
        """Estimated parameter bytes of a stage holding ``layers`` (and the ends it owns)."""
        total = sum(self.layer_bytes[layers.start : layers.end])
        if first:
            total += self.embedding_bytes
        if last:
            total += self.lm_head_bytes
        if first and last:
            total -= self.shared_end_bytes
        return total

    def kind_summary(self, layers: LayerRange) -> str:
        """'12 attention+moe, 3 mamba+mlp' for the blocks of ``layers``."""
        counts = Counter(self.layer_kinds[layers.start : layers.end])
        return ", ".join(f"{n} {kind}" for kind, n in counts.most_common())


def _pricer(config: Mapping[str, Any], notes: list[str]) -> Pricer:
    if not isinstance(config, Mapping):
        raise ConfigurationError("expected a JSON object", source="config.json")
    return Pricer(dtype_bytes_from_config(config, notes), quantization_from_config(config, notes))


def _layout(config: Mapping[str, Any], pricer: Pricer, notes: list[str]) -> Layout:
    model_type = str(config.get("model_type", ""))
    spec = FAMILIES.get(model_type)
    layout = (spec.profile if spec is not None else dense_fallback)(config, pricer)
    layout.notes[:0] = notes
    return layout


def _storage(pricer: Pricer) -> str:
    floats = f"{pricer.dtype_bytes * 8}-bit floats"
    q = pricer.quant.default
    if q is None:
        return f"unquantized ({floats})"
    text = f"{q.bits}-bit {q.mode}, group size {q.group_size}"
    if pricer.quant.experts_only:
        text += " (experts only)"
    if pricer.quant.overrides:
        text += f", {len(pricer.quant.overrides)} per-module override(s)"
    return f"{text}; other tensors {floats}"


def profile_from_config(config: Mapping[str, Any]) -> ModelProfile:
    """The profile of the model ``config`` (a parsed config.json) describes.

    Raises ConfigurationError naming the missing or malformed key.
    """
    notes: list[str] = []
    pricer = _pricer(config, notes)
    layout = _layout(config, pricer, notes)
    return ModelProfile(
        model_type=str(config.get("model_type", "")),
        family=layout.family,
        layer_bytes=tuple(part.nbytes for part in layout.layers),
        layer_kinds=tuple(layout.kinds),
        embedding_bytes=layout.embedding.nbytes,
        lm_head_bytes=layout.head.nbytes + layout.tied_table,
        shared_end_bytes=layout.tied_table,
        adjacency_groups=tuple(sorted(layout.groups)),
        pipeline_refusal=layout.refusal,
        notes=tuple(layout.notes),
        storage=_storage(pricer),
    )


def profile_tensors(config: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Every priced tensor by part: ``{"embedding": {...}, "head": {...}, "layer.3": {...}}``.

    Names are mlx-lm's parameter names (``model.layers.3.mlp.gate_proj.scales``); the head part
    leaves out the tied table, which the last stage shares with the embedding part.
    """
    notes: list[str] = []
    layout = _layout(config, _pricer(config, notes), notes)
    parts = {"embedding": layout.embedding.tensors, "head": layout.head.tensors}
    parts.update({f"layer.{i}": part.tensors for i, part in enumerate(layout.layers)})
    return parts


def read_model_config(path: Path) -> ModelConfig:
    """config.json of a model directory, or the file itself when ``path`` is a JSON file.

    The one reader of config.json (the engine, runtime and CLI all use it): a missing file,
    malformed JSON or a non-object raise ConfigurationError saying which.
    """
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        where = f"{path} has no config.json" if path.is_dir() else f"{path} does not exist"
        raise ConfigurationError(
            f"{where}; point --model at an mlx-lm model directory or its config.json",
            source="--model",
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigurationError(
            f"not valid JSON (line {exc.lineno}): {exc.msg}", source=str(file)
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read it: {exc}", source=str(file)) from None
    if not isinstance(config, dict):
        raise ConfigurationError("expected a JSON object", source=str(file))
    return config
