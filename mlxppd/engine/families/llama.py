"""Llama-family stages (model_type ``llama`` and ``mistral``), built from mlx-lm's own blocks.

Reusing mlx-lm's ``TransformerBlock`` keeps the arithmetic identical to single-process mlx-lm,
which is what makes greedy token parity hold for every split.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.llama import ModelArgs, TransformerBlock

from mlxppd.core.stages import StageSpec

WIRE_NAME = "llama"
MODEL_TYPES = ("llama", "mistral")

_LAYER_PREFIX = "model.layers."


def num_layers(config: dict[str, Any]) -> int:
    return int(config["num_hidden_layers"])


class LlamaStage(nn.Module):
    def __init__(self, args: ModelArgs, spec: StageSpec):
        super().__init__()
        self.spec = spec
        self.tied = bool(args.tie_word_embeddings)
        self.sliding_window = args.sliding_window
        layer_types = args.layer_types or ["full_attention"] * args.num_hidden_layers
        # With tied embeddings the last stage needs the table too: it is the output projection.
        if spec.has_embedding or (spec.has_lm_head and self.tied):
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            TransformerBlock(args, use_sliding=layer_types[i] == "sliding_attention")
            for i in range(spec.start, spec.end)
        ]
        if spec.has_lm_head:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            if not self.tied:
                self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def local_weight_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to this stage's parameter name, or None if not ours."""
        if name.startswith(_LAYER_PREFIX):
            index_text, _, rest = name[len(_LAYER_PREFIX) :].partition(".")
            layer = int(index_text)
            if not self.spec.owns_layer(layer) or "rotary_emb" in rest:
                return None
            return f"layers.{layer - self.spec.start}.{rest}"
        if name.startswith("model.embed_tokens."):
            keep = self.spec.has_embedding or (self.spec.has_lm_head and self.tied)
            return name[len("model.") :] if keep else None
        if name.startswith("model.norm."):
            return name[len("model.") :] if self.spec.has_lm_head else None
        if name.startswith("lm_head."):
            return name if self.spec.has_lm_head and not self.tied else None
        return None

    def make_cache(self) -> list[Any]:
        return [
            RotatingKVCache(max_size=self.sliding_window) if layer.use_sliding else KVCache()
            for layer in self.layers
        ]

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        h = self.embed_tokens(x) if self.spec.has_embedding else x
        full_mask = sliding_mask = None
        for layer, c in zip(self.layers, cache, strict=True):
            # Masks depend only on the cache offset, shared by every layer of a kind.
            if layer.use_sliding:
                if sliding_mask is None:
                    sliding_mask = create_attention_mask(h, c, window_size=self.sliding_window)
                mask = sliding_mask
            else:
                if full_mask is None:
                    full_mask = create_attention_mask(h, c)
                mask = full_mask
            h = layer(h, mask, cache=c)
        if not self.spec.has_lm_head:
            return h
        h = self.norm(h)
        return self.embed_tokens.as_linear(h) if self.tied else self.lm_head(h)


def build_stage(config: dict[str, Any], spec: StageSpec) -> LlamaStage:
    return LlamaStage(ModelArgs.from_dict(config), spec)
