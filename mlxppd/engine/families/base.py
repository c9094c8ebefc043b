"""The stage-executor contract every family module fills in, and the shared defaults.

A stage keeps mlx-lm's own ``Model`` object for its family, pruned to what the stage owns: the
layer list keeps its length (layers of other stages become ``None``), so layer indices stay the
global ones and parameter names stay the checkpoint's. A family says how to run a slice of its
layers (masks, caches, extra per-layer inputs) and how the ends work (embedding, norm, head).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import KVCache

from mlxppd.core.stages import StageSpec

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (VLM configs nest it under ``text_config``)."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def layer_index(name: str) -> int | None:
    """The global block index in a checkpoint tensor name, or None for non-layer tensors."""
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def owned(spec: StageSpec, layers: list[Any]) -> list[tuple[int, Any]]:
    """(global index, layer) for every layer this stage runs."""
    return [(i, layers[i]) for i in range(spec.start, spec.end)]


def run_attention_and_recurrent(
    layers: list[tuple[int, Any]],
    h: mx.array,
    cache: list[Any],
    is_attention: Callable[[Any], bool],
) -> mx.array:
    """Run attention and recurrent (SSM / linear-attention) blocks, each with its kind's mask.

    The full model builds one mask per block kind from the first cache of that kind; every
    cache of a kind has the same offset, so the stage's first one gives the same mask.
    """
    masks: dict[bool, Any] = {}
    for (_, layer), c in zip(layers, cache, strict=True):
        kind = is_attention(layer)
        if kind not in masks:
            masks[kind] = create_attention_mask(h, c) if kind else create_ssm_mask(h, c)
        h = layer(h, mask=masks[kind], cache=c)
    return h


class Family:
    """Defaults fit a llama-like model: ``model.model.{embed_tokens,layers,norm}`` + ``lm_head``."""

    #: names of the output projection on the top-level model, when it is not tied
    HEAD_NAMES: ClassVar[tuple[str, ...]] = ("lm_head",)
    #: MLA families want the causal mask as an array, never the "causal" shortcut
    MASK_AS_ARRAY: ClassVar[bool] = False

    def num_layers(self, config: dict[str, Any]) -> int:
        return int(text_config(config)["num_hidden_layers"])

    def inner(self, model: nn.Module) -> nn.Module:
        """The module holding embed_tokens, layers and the final norm."""
        return model.model

    def head_owner(self, model: nn.Module) -> nn.Module:
        """The module holding the output projection (VLM wrappers nest it)."""
        return model

    def layers(self, model: nn.Module) -> list[Any]:
        return self.inner(model).layers

    def tied(self, model: nn.Module) -> bool:
        return not any(name in self.head_owner(model) for name in self.HEAD_NAMES)

    def check_split(self, config: dict[str, Any], spec: StageSpec) -> None:
        """Refuse a boundary the family cannot cross (e.g. inside a KV-sharing group)."""

    def prune(self, model: nn.Module, spec: StageSpec) -> None:
        """Drop everything the stage does not run; layers outside the range become None."""
        inner = self.inner(model)
        layers = self.layers(model)
        for i in range(len(layers)):
            if not spec.owns_layer(i):
                layers[i] = None
        keep_embedding = spec.has_embedding or (spec.has_lm_head and self.tied(model))
        if not keep_embedding and "embed_tokens" in inner:
            inner.pop("embed_tokens")
        if not spec.has_lm_head:
            if "norm" in inner:
                inner.pop("norm")
            owner = self.head_owner(model)
            for name in self.HEAD_NAMES:
                if name in owner:
                    owner.pop(name)

    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        return [KVCache() for _ in range(spec.num_layers)]

    def embed(self, model: nn.Module, tokens: mx.array) -> mx.array:
        return self.inner(model).embed_tokens(tokens)

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        mask = create_attention_mask(h, cache[0], return_array=self.MASK_AS_ARRAY)
        for (_, layer), c in zip(owned(spec, self.layers(model)), cache, strict=True):
            h = layer(h, mask, cache=c)
        return h

    def head(self, model: nn.Module, h: mx.array) -> mx.array:
        h = self.inner(model).norm(h)
        if self.tied(model):
            return self.inner(model).embed_tokens.as_linear(h)
        owner = self.head_owner(model)
        return next(owner[n] for n in self.HEAD_NAMES if n in owner)(h)


class StageNet:
    """One family's pruned model plus the stage it runs: ``net(x, cache)``."""

    def __init__(self, family: Family, model: nn.Module, spec: StageSpec):
        self.family = family
        self.model = model
        self.spec = spec

    def make_cache(self) -> list[Any]:
        return self.family.make_cache(self.model, self.spec)

    def __call__(self, x: mx.array, cache: list[Any], head: bool = True) -> mx.array:
        """``head=False``: the last stage stops before its output head (a prefill chunk whose
        logits nobody samples: the head is a fifth of a small model's weights)."""
        h = self.family.embed(self.model, x) if self.spec.has_embedding else x
        h = self.family.run_layers(self.model, h, cache, self.spec)
        return self.family.head(self.model, h) if self.spec.has_lm_head and head else h
