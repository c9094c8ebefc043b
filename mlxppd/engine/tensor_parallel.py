"""Tensor-parallel ranks of a stage: mlx-lm's own ``shard()`` over MLX's own collectives.

A stage of ``T`` ranks is ``T`` processes that each load the stage's layers and keep only
their shard of them: mlx-lm's ``Model.shard(group)`` replaces the attention and MLP
projections with sharded ones whose partial results are summed over the group with
``mx.distributed.all_sum`` (the ring backend over TCP here; MLX's RDMA backend where the
platform has it). Every rank runs every forward pass in the same order on the same input, so
their outputs are equal; rank 0 is the one that speaks for the stage.

MLX's collectives are neither encrypted nor authenticated: tensor-parallel links must be
private (a direct cable or an isolated network); ``docs/tensor-parallel.md`` says so, and
``tp_address_warning`` names a peer that is not on a loopback, link-local or private network.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import replace
from typing import Any

import mlx.core as mx

from mlxppd.core.errors import ConfigurationError
from mlxppd.engine.stage import LoadedStage, held_bytes, model_classes

__all__ = ["init_group", "shard_stage", "tp_address_warning", "tp_refusal"]

#: the config keys whose counts every rank must split evenly (heads, KV heads, MLP width)
_SPLIT_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def tp_refusal(config: dict[str, Any], tp: int) -> str | None:
    """Why this model cannot run ``tp`` tensor-parallel ranks per stage (None: it can)."""
    if tp <= 1:
        return None
    text = config.get("text_config", config)
    model_type = config.get("model_type", "?")
    model_class, _ = model_classes(config)
    if not hasattr(model_class, "shard"):
        return (
            f"model_type {model_type!r} has no tensor-parallel sharding in mlx-lm (its Model "
            f"has no shard()); run it with --tp-size 1, pipeline stages only"
        )
    for key in _SPLIT_KEYS:
        count = text.get(key)
        if isinstance(count, int) and count % tp:
            fits = [d for d in range(1, count + 1) if all(
                not isinstance(text.get(k), int) or text[k] % d == 0 for k in _SPLIT_KEYS
            )]  # fmt: skip
            return (
                f"{key} = {count} of model_type {model_type!r} does not split over {tp} "
                f"tensor-parallel ranks; use a --tp-size that divides every count "
                f"({', '.join(str(d) for d in fits)})"
            )
    return None


def init_group(tp: int) -> mx.distributed.Group:
    """This process's tensor-parallel group, from MLX's launch environment (``MLX_RANK``,
    ``MLX_HOSTFILE``): the ring backend, whose size must be ``tp``."""
    group = mx.distributed.init(strict=True, backend="ring")
    if group.size() != tp:
        raise ConfigurationError(
            f"the tensor-parallel group has {group.size()} ranks, not {tp}; the hostfile in "
            "MLX_HOSTFILE must list one address per rank",
            source="MLX_HOSTFILE",
        )
    return group


def shard_stage(stage: LoadedStage, group: mx.distributed.Group) -> LoadedStage:
    """``stage`` with only this rank's shard of its layers (mlx-lm's ``shard()``, applied to
    the stage's own layers: the ones it does not run are None and stay so)."""
    net = stage.net
    holder = net.family.inner(net.model)
    every = holder.layers
    own = [layer for layer in every if layer is not None]
    holder.layers = own  # shard() walks model.layers; hand it this stage's only
    try:
        net.model.shard(group)
    finally:
        holder.layers = every  # the same (now sharded) layer objects, in their places
    mx.eval(net.model.parameters())
    return replace(stage, parameter_bytes=held_bytes(net.model))


def tp_address_warning(host: str) -> str | None:
    """A sentence when a tensor-parallel peer's address is not private (MLX's collectives
    travel in clear); None for loopback, link-local and private addresses (and names, which
    cannot be judged here)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if address.is_loopback or address.is_link_local or address.is_private:
        return None
    return (
        f"tensor-parallel peer {host} is not on a loopback, link-local or private network; "
        "MLX's collectives are not encrypted: put the ranks of a stage on a direct cable or an "
        "isolated network"
    )


def hostfile(addresses: list[str]) -> str:
    """The ring backend's hostfile: one list of ``host:port`` per rank, rank order."""
    return json.dumps([[a] for a in addresses])
