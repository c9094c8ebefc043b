"""Nemotron-H (model_type ``nemotron_h``): Mamba2 (M), attention (*), MLP (-) and MoE (E) blocks.

The modules live under ``backbone`` (``embeddings``, ``layers``, ``norm_f``) and the head is
always an untied ``lm_head``. Only M and * blocks carry state, so the full model's cache list
skips the others; a stage keeps the same rule for the blocks it owns. A split may fall between
any two blocks, since only the hidden state crosses it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.nemotron_h import ModelArgs

from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import Family, owned, text_config

_STATEFUL = ("M", "*")


class NemotronHFamily(Family):
    def num_layers(self, config: dict[str, Any]) -> int:
        # The block pattern, not num_hidden_layers (often absent), is the layer count.
        return int(ModelArgs.from_dict(text_config(config)).num_hidden_layers or 0)

    def inner(self, model: nn.Module) -> nn.Module:
        return model.backbone

    def tied(self, model: nn.Module) -> bool:
        return False

    def prune(self, model: nn.Module, spec: StageSpec) -> None:
        inner = self.inner(model)
        layers = self.layers(model)
        for i in range(len(layers)):
            if not spec.owns_layer(i):
                layers[i] = None
        if not spec.has_embedding:
            inner.pop("embeddings")
        if not spec.has_lm_head:
            inner.pop("norm_f")
            model.pop("lm_head")

    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        return [
            KVCache() if layer.block_type == "*" else ArraysCache(size=2)
            for _, layer in owned(spec, self.layers(model))
            if layer.block_type in _STATEFUL
        ]

    def embed(self, model: nn.Module, tokens: mx.array) -> mx.array:
        return self.inner(model).embeddings(tokens)

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        stateful = iter(cache)
        attn_mask: Any = None
        ssm_mask: Any = None
        have_attn = have_ssm = False
        for _, layer in owned(spec, self.layers(model)):
            c = next(stateful) if layer.block_type in _STATEFUL else None
            # As in the full model: each mask comes from the first cache of its kind (all
            # caches of one kind share an offset); MLP/MoE blocks get the SSM mask, unused.
            if layer.block_type == "*" and not have_attn:
                attn_mask, have_attn = create_attention_mask(h, c), True
            elif layer.block_type == "M" and not have_ssm:
                ssm_mask, have_ssm = create_ssm_mask(h, c), True
            h = layer(h, mask=attn_mask if layer.block_type == "*" else ssm_mask, cache=c)
        return h

    def head(self, model: nn.Module, h: mx.array) -> mx.array:
        return model.lm_head(self.inner(model).norm_f(h))


FAMILY = NemotronHFamily()
