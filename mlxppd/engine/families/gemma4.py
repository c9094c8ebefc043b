"""Gemma 4 (model_types ``gemma4_text``, and ``gemma4`` / ``gemma4_unified``: the VLM's text path).

Three things make it more than a sliced decoder:

- KV sharing: the last ``num_kv_shared_layers`` blocks have no K/V projections and attend over
  the keys/values (and rope offset) the last earlier block of their kind produced in the same
  forward pass. Those arrays never leave a stage, so a (source, consumer) pair must not be cut
  by a boundary: ``check_split`` refuses that, naming the pair.
- Per-layer inputs: the embedding stage computes one small input per block from the token ids.
  They travel with the hidden state as ONE tensor: ``[h | inputs of blocks start..N-1]`` along
  the last axis; each stage peels off its own blocks' inputs and forwards the rest.
- The head softcaps the logits (``final_logit_softcapping``) exactly as mlx-lm does.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import Family, owned, text_config

# Non-layer modules only the embedding stage runs (per-layer input embedding + projection).
_PER_LAYER_INPUT_MODULES = (
    "embed_tokens_per_layer",
    "per_layer_model_projection",
    "per_layer_projection_norm",
)


def kv_sources(layer_types: list[str], num_kv_shared: int) -> dict[int, int]:
    """consumer -> source for every KV-shared block (mlx-lm's ``previous_kvs`` rule)."""
    n = len(layer_types)
    first_shared = n - num_kv_shared
    if num_kv_shared <= 0 or first_shared <= 0:
        return {}
    last_of_kind = {layer_types[i]: i for i in range(first_shared)}
    return {j: last_of_kind[layer_types[j]] for j in range(first_shared, n)}


class Gemma4Family(Family):
    def text(self, model: nn.Module) -> nn.Module:
        """mlx-lm's text ``Model`` (the VLM wraps it as ``language_model``)."""
        return model.language_model if "language_model" in model else model

    def inner(self, model: nn.Module) -> nn.Module:
        return self.text(model).model

    def tied(self, model: nn.Module) -> bool:
        return bool(self.text(model).tie_word_embeddings)

    def check_split(self, config: dict[str, Any], spec: StageSpec) -> None:
        args = gemma4_text.ModelArgs.from_dict(text_config(config))
        layer_types = list(args.layer_types or [])
        for consumer, source in kv_sources(layer_types, args.num_kv_shared_layers).items():
            if spec.owns_layer(consumer) != spec.owns_layer(source):
                raise ConfigurationError(
                    f"layers {source} and {consumer} share a KV cache (layer {consumer} reads "
                    f"layer {source}'s keys and values); put them in the same stage",
                    source="--pp-layers",
                )

    def prune(self, model: nn.Module, spec: StageSpec) -> None:
        text, inner = self.text(model), self.inner(model)
        tied = self.tied(model)
        layers = self.layers(model)
        for i in range(len(layers)):
            if not spec.owns_layer(i):
                layers[i] = None
        if not spec.has_embedding:
            for name in _PER_LAYER_INPUT_MODULES:
                inner.pop(name, None)
            if not (spec.has_lm_head and tied):
                inner.pop("embed_tokens")
        if not spec.has_lm_head:
            inner.pop("norm")
            text.pop("lm_head", None)

    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        # Only blocks with their own K/V projections have a cache; consumers read their source's.
        window = self.inner(model).window_size
        return [
            RotatingKVCache(max_size=window, keep=0) if layer.self_attn.is_sliding else KVCache()
            for _, layer in owned(spec, self.layers(model))
            if layer.self_attn.has_kv
        ]

    def embed(self, model: nn.Module, tokens: mx.array) -> mx.array:
        inner = self.inner(model)
        embeddings = inner.embed_tokens(tokens)
        h = embeddings * inner.embed_scale
        if not inner.hidden_size_per_layer_input:
            return h
        per_layer = inner._get_per_layer_inputs(tokens, embeddings)
        per_layer = inner._project_per_layer_inputs(h, per_layer)
        return mx.concatenate([h, mx.flatten(per_layer, -2)], axis=-1)

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        inner = self.inner(model)
        per_size = inner.hidden_size_per_layer_input
        hidden = inner.config.hidden_size
        per_layer: mx.array | None = None
        if per_size:
            # The payload carries inputs for blocks spec.start..N-1; peel off this stage's.
            per_layer = mx.unflatten(h[..., hidden:], -1, (-1, per_size))
            h = h[..., :hidden]
        layers = owned(spec, self.layers(model))
        caches = iter(cache)
        layer_cache = {i: next(caches) if layer.self_attn.has_kv else None for i, layer in layers}

        # One mask per attention kind, from the stage's first cache of that kind, as the full
        # model does (a consumer's source is in this stage, so that cache exists here too).
        masks: dict[str, Any] = {}
        for i, layer in layers:
            kind, c = layer.layer_type, layer_cache[i]
            if kind not in masks and c is not None:
                window = inner.window_size if kind == "sliding_attention" else None
                masks[kind] = create_attention_mask(h, c, window_size=window)

        shared: dict[int, tuple[Any, Any]] = {}
        for i, layer in layers:
            source = inner.previous_kvs[i]
            kvs, offset = shared.get(source, (None, None)) if source != i else (None, None)
            h, kvs, offset = layer(
                h,
                masks.get(layer.layer_type),
                layer_cache[i],
                per_layer_input=None if per_layer is None else per_layer[:, :, i - spec.start],
                shared_kv=kvs,
                offset=offset,
            )
            shared[i] = (kvs, offset)

        if per_layer is None or spec.has_lm_head:
            return h
        rest = per_layer[:, :, spec.end - spec.start :]
        return mx.concatenate([h, mx.flatten(rest, -2)], axis=-1)

    def head(self, model: nn.Module, h: mx.array) -> mx.array:
        text, inner = self.text(model), self.inner(model)
        h = inner.norm(h)
        out = inner.embed_tokens.as_linear(h) if self.tied(model) else text.lm_head(h)
        if text.final_logit_softcapping is not None:
            out = gemma4_text.logit_softcap(text.final_logit_softcapping, out)
        return out


FAMILY = Gemma4Family()
