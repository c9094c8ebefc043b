"""Llama family (model_type ``llama`` and ``mistral``): mlx-lm's ``llama`` model, sliced.

Sliding-window layers (``layer_types``) take the sliding mask and a rotating cache by their
global index, exactly as the full model does.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import Family, owned


class LlamaFamily(Family):
    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        window = self.inner(model).sliding_window
        return [
            RotatingKVCache(max_size=window) if layer.use_sliding else KVCache()
            for _, layer in owned(spec, self.layers(model))
        ]

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        window = self.inner(model).sliding_window
        masks: dict[bool, Any] = {}
        for (_, layer), c in zip(owned(spec, self.layers(model)), cache, strict=True):
            # The full model builds each mask from the first cache of its kind; any cache of
            # that kind has the same offset, so the stage's first one gives the same mask.
            if layer.use_sliding not in masks:
                masks[layer.use_sliding] = create_attention_mask(
                    h, c, window_size=window if layer.use_sliding else None
                )
            h = layer(h, masks[layer.use_sliding], cache=c)
        return h


FAMILY = LlamaFamily()
