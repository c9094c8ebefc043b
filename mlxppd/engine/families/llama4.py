"""Llama 4: the Scout text tower (``llama4``, VLM wrapper) and ``llama4_text``.

The Scout tower interleaves chunked local attention (three layers in four, by global index)
with global attention; chunked caches trim their front before each step as in the full model.
The vision encoder is out of scope: its tensors are dropped by mlx-lm's ``sanitize``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ChunkedKVCache, KVCache

from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import Family, owned


def _chunked(index: int) -> bool:
    return (index + 1) % 4 != 0


class Llama4Family(Family):
    """model_type ``llama4``: ``language_model.{model,lm_head}``."""

    def head_owner(self, model: nn.Module) -> nn.Module:
        return model.language_model

    def inner(self, model: nn.Module) -> nn.Module:
        return model.language_model.model

    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        chunk = self.inner(model).attention_chunk_size
        return [
            ChunkedKVCache(chunk) if _chunked(i) else KVCache()
            for i, _ in owned(spec, self.layers(model))
        ]

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        layers = owned(spec, self.layers(model))
        chunk_size = self.inner(model).attention_chunk_size
        chunk_mask = global_mask = None
        for (i, _), c in zip(layers, cache, strict=True):
            if _chunked(i):
                c.maybe_trim_front()
        for (i, _), c in zip(layers, cache, strict=True):
            if _chunked(i) and chunk_mask is None:
                start, offset = c.start_position, c.offset
                end = offset + h.shape[1]
                linds = mx.arange(start, end)
                rinds = mx.arange(offset, end)[:, None]
                block_pos = mx.abs((linds // chunk_size) - (rinds // chunk_size))
                chunk_mask = (block_pos == 0) & (linds <= rinds)
            if not _chunked(i) and global_mask is None:
                global_mask = create_attention_mask(h, c)
        for (i, layer), c in zip(layers, cache, strict=True):
            h = layer(h, chunk_mask if _chunked(i) else global_mask, cache=c)
        return h


class Llama4TextFamily(Family):
    """model_type ``llama4_text``: head ``output``, or the embedding matrix when tied."""

    HEAD_NAMES = ("output",)

    def head(self, model: nn.Module, h: mx.array) -> mx.array:
        h = self.inner(model).norm(h)
        if self.tied(model):
            return h @ self.inner(model).embed_tokens.weight.T
        return model.output(h)


FAMILY = Llama4Family()
TEXT = Llama4TextFamily()
