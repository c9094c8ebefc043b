"""Which checkpoint tensors a pipeline stage owns, by name (pure).

A decoder layer's tensors carry its index (``model.layers.12.mlp...``); the rest belong to the
ends of the pipeline: the token embedding to the first stage (and to the last when the output
head is tied to it), everything else without a layer index (final norm, output head) to the
last. A node's identity digest, and what ``mlxppctl prepare`` ships it, cover exactly these.
"""

from __future__ import annotations

import re

from mlxppd.core.stages import StageSpec

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to, or None for the embedding, norm and head."""
    found = _LAYER.search(name)
    return int(found.group(1)) if found else None


def owned_by(name: str, spec: StageSpec, tied_embeddings: bool) -> bool:
    """True when stage ``spec`` needs checkpoint tensor ``name``."""
    layer = layer_of(name)
    if layer is not None:
        return spec.owns_layer(layer)
    if "embed" in name:
        return spec.has_embedding or (spec.has_lm_head and tied_embeddings)
    return spec.has_lm_head
