"""Jamba (model_type ``jamba``): Mamba and attention blocks, dense or MoE feed-forward.

Each owned block keeps its own state: a KV cache for attention, a (conv, ssm) ``ArraysCache``
for Mamba. Nothing crosses a stage boundary but the hidden state, so a split may fall between any
two blocks. The final norm is ``final_layernorm``, not ``norm``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import Family, owned, run_attention_and_recurrent


class JambaFamily(Family):
    def prune(self, model: nn.Module, spec: StageSpec) -> None:
        super().prune(model, spec)
        if not spec.has_lm_head:
            self.inner(model).pop("final_layernorm")

    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        return [
            KVCache() if layer.is_attn else ArraysCache(size=2)
            for _, layer in owned(spec, self.layers(model))
        ]

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        return run_attention_and_recurrent(
            owned(spec, self.layers(model)), h, cache, lambda block: block.is_attn
        )

    def head(self, model: nn.Module, h: mx.array) -> mx.array:
        inner = self.inner(model)
        h = inner.final_layernorm(h)
        if self.tied(model):
            return inner.embed_tokens.as_linear(h)
        return model.lm_head(h)


FAMILY = JambaFamily()
