"""Gemma 3 text (``gemma3_text``) and the text path of the Gemma 3 VLM (``gemma3``).

Embeddings are scaled by sqrt(hidden) (in bfloat16, as mlx-lm does); every
``sliding_window_pattern``-th layer (by global index) is global, the others slide.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import Family, owned


class Gemma3Family(Family):
    def __init__(self, vlm: bool):
        self.vlm = vlm

    def head_owner(self, model: nn.Module) -> nn.Module:
        return model.language_model if self.vlm else model

    def inner(self, model: nn.Module) -> nn.Module:
        return self.head_owner(model).model

    def _is_global(self, model: nn.Module, index: int) -> bool:
        pattern = self.inner(model).sliding_window_pattern
        return bool(index % pattern == pattern - 1)

    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        window = self.inner(model).window_size
        return [
            KVCache() if self._is_global(model, i) else RotatingKVCache(max_size=window)
            for i, _ in owned(spec, self.layers(model))
        ]

    def embed(self, model: nn.Module, tokens: mx.array) -> mx.array:
        inner = self.inner(model)
        h = inner.embed_tokens(tokens)
        return h * mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        window = self.inner(model).window_size
        masks: dict[bool, Any] = {}
        for (i, layer), c in zip(owned(spec, self.layers(model)), cache, strict=True):
            is_global = self._is_global(model, i)
            if is_global not in masks:
                masks[is_global] = create_attention_mask(
                    h, c, window_size=None if is_global else window
                )
            h = layer(h, masks[is_global], c)
        return h


FAMILY = Gemma3Family(vlm=False)
VLM = Gemma3Family(vlm=True)
