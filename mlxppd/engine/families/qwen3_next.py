"""Qwen3-Next (model_type ``qwen3_next``): gated delta net blocks and full attention, MoE MLPs.

A block is linear (gated delta net, an ``ArraysCache`` of conv + recurrent state) unless
``(index + 1) % full_attention_interval == 0``; mlx-lm's block decides that from its global
index when the full skeleton is built, so a stage's owned blocks are already the right kind.
Only the hidden state crosses a boundary, so a split may fall between any two blocks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import Family, owned, run_attention_and_recurrent


class Qwen3NextFamily(Family):
    def lm(self, model: nn.Module) -> nn.Module:
        """The module holding ``model`` (the inner stack), ``args`` and the optional lm_head."""
        return model

    def inner(self, model: nn.Module) -> nn.Module:
        return self.lm(model).model

    def tied(self, model: nn.Module) -> bool:
        return bool(self.lm(model).args.tie_word_embeddings)

    def prune(self, model: nn.Module, spec: StageSpec) -> None:
        tied = self.tied(model)
        inner = self.inner(model)
        layers = self.layers(model)
        for i in range(len(layers)):
            if not spec.owns_layer(i):
                layers[i] = None
        if not (spec.has_embedding or (spec.has_lm_head and tied)):
            inner.pop("embed_tokens")
        if not spec.has_lm_head:
            inner.pop("norm")
            if "lm_head" in self.lm(model):
                self.lm(model).pop("lm_head")

    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        return [
            ArraysCache(size=2) if layer.is_linear else KVCache()
            for _, layer in owned(spec, self.layers(model))
        ]

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        return run_attention_and_recurrent(
            owned(spec, self.layers(model)), h, cache, lambda block: not block.is_linear
        )

    def head(self, model: nn.Module, h: mx.array) -> mx.array:
        h = self.inner(model).norm(h)
        if self.tied(model):
            return self.inner(model).embed_tokens.as_linear(h)
        return self.lm(model).lm_head(h)


FAMILY = Qwen3NextFamily()
