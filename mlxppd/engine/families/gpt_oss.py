"""GPT-OSS: alternating sliding-window and full attention, MoE (MXFP4) blocks.

A layer's kind comes from ``layer_types`` by its global index; each mask is built from the
stage's first cache of that kind, which has the same offset as the full model's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import Family, owned


class GptOssFamily(Family):
    def _kinds(self, model: nn.Module, spec: StageSpec) -> list[str]:
        types = self.inner(model).layer_types
        return [types[i] for i, _ in owned(spec, self.layers(model))]

    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        window = self.inner(model).window_size
        return [
            KVCache() if kind == "full_attention" else RotatingKVCache(max_size=window)
            for kind in self._kinds(model, spec)
        ]

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        window = self.inner(model).window_size
        masks: dict[str, Any] = {}
        layers = owned(spec, self.layers(model))
        for kind, (_, layer), c in zip(self._kinds(model, spec), layers, cache, strict=True):
            if kind not in masks:
                full = kind == "full_attention"
                masks[kind] = create_attention_mask(h, c, window_size=None if full else window)
            h = layer(h, masks[kind], c)
        return h


FAMILY = GptOssFamily()
