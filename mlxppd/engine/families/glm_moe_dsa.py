"""GLM MoE DSA, on mlx-lm's DeepSeek V3.2 model: MLA plus a sparse-attention indexer.

Each block's cache is a pair (attention keys/values, indexer keys); the mask comes from the
first block's attention cache, as in the full model.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache

from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import Family, owned


class GlmMoeDsaFamily(Family):
    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        return [CacheList(KVCache(), KVCache()) for _ in range(spec.num_layers)]

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        mask = create_attention_mask(h, cache[0][0], return_array=True)
        for (_, layer), c in zip(owned(spec, self.layers(model)), cache, strict=True):
            h = layer(h, mask, c)
        return h


FAMILY = GlmMoeDsaFamily()
