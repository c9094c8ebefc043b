"""Putting adapters on a stage's modules: fused into the weights, or kept apart per request.

Fused (one adapter for every request): each adapted module becomes mlx-lm's own LoRA or DoRA
layer over it, with the file's tensors, then that layer's ``fuse()`` (quantized bases are
quantized again, as ``mlx_lm fuse`` does).

Per request (several adapters, each request naming one): an adapted module keeps its class's
computation and gains a bank of the adapters loaded on it. Its class is swapped for a subclass
whose ``__call__`` adds the low-rank update of the adapter each batch row runs (mlx-lm's
formulas, so a row equals single-process mlx-lm with that adapter); parameter names and the
module tree do not change, and the bank's tensors are not parameters of the model. An MoE
expert layer may see its rows sorted by expert (mlx-lm's ``SwitchGLU`` sorts 64 entries or
more): its parent records the routing so the rows can be told apart there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import (
    QuantizedSwitchLinear,
    SwitchGLU,
    SwitchLinear,
    SwitchMLP,
)

from mlxppd.core.errors import ConfigurationError
from mlxppd.engine.adapters.reader import AdapterWeights

__all__ = ["Selection", "fuse_adapter", "add_named", "remove_named", "named_on"]

_LINEAR = (nn.Linear, nn.QuantizedLinear)
_SWITCH = (SwitchLinear, QuantizedSwitchLinear)


class Selection:
    """Which adapter each row of the batch being built runs (None: the base model); set by
    the stage's runner before each forward pass."""

    def __init__(self) -> None:
        self.rows: tuple[str | None, ...] = ()
        #: the expert routing of the MoE block being built (its entries are sorted by expert)
        self.routing: mx.array | None = None

    def flags(self, name: str) -> mx.array:
        return mx.array([row == name for row in self.rows])


def _resolve(model: nn.Module, path: str) -> tuple[Any, str, Any]:
    """(parent, key, module) for a dotted path; list indices are numbers in the path."""
    parent: Any = None
    key = ""
    node: Any = model
    for part in path.split("."):
        parent, key = node, part
        if isinstance(node, list):
            node = node[int(part)] if part.isdigit() and int(part) < len(node) else None
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            node = getattr(node, part, None)
        if node is None:
            raise KeyError(path)
    return parent, key, node


def _set(parent: Any, key: str, module: nn.Module) -> None:
    if isinstance(parent, list):
        parent[int(key)] = module
    else:
        parent[key] = module


def _refuse(family: str, module: str, what: Any, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"model_type {family!r} cannot take this adapter on {module} ({type(what).__name__}): "
        f"{why}",
        source="--adapter",
    )


def _lookup(model: nn.Module, family: str, module: str) -> tuple[Any, str, Any]:
    try:
        return _resolve(model, module)
    except KeyError:
        raise ConfigurationError(
            f"adapts {module}, which model_type {family!r} does not have; was it trained on "
            "another model?",
            source="--adapter",
        ) from None


def _mlx_layer(base: Any, weights: AdapterWeights, leaves: dict[str, mx.array], family: str,
               module: str) -> Any:  # fmt: skip
    """mlx-lm's LoRA or DoRA layer over ``base`` holding the file's tensors."""
    # mlx-lm's tuner package imports its trainer (and transformers): only when an adapter is used.
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear

    cfg = weights.config
    if isinstance(base, _LINEAR):
        cls: Any = DoRALinear if cfg.kind == "dora" else LoRALinear
    elif isinstance(base, _SWITCH):
        if cfg.kind == "dora":
            raise _refuse(family, module, base, "mlx-lm has no DoRA for MoE expert layers")
        cls = LoRASwitchLinear
    else:
        raise _refuse(family, module, base, "mlx-lm's LoRA converts linear layers only")
    layer = cls.from_base(base, r=cfg.rank, scale=cfg.scale, dropout=0.0)
    for leaf, tensor in leaves.items():
        held = getattr(layer, leaf, None)
        if held is None or tuple(held.shape) != tuple(tensor.shape):
            raise ConfigurationError(
                f"its {module}.{leaf} has shape {tuple(tensor.shape)}, the model's "
                f"{None if held is None else tuple(held.shape)}; was it trained on another model?",
                source=str(weights.path),
            )
        setattr(layer, leaf, tensor)  # the file's dtype, as mlx-lm's load_adapters keeps it
    return layer


def fuse_adapter(model: nn.Module, weights: AdapterWeights, family: str) -> int:
    """Fuse ``weights`` into ``model``'s modules; returns how many modules changed."""
    for module, leaves in sorted(weights.modules.items()):
        parent, key, base = _lookup(model, family, module)
        layer = _mlx_layer(base, weights, leaves, family, module)
        _set(parent, key, layer.fuse(dequantize=False))
    mx.eval(model.parameters())
    return len(weights.modules)


# -- per request --------------------------------------------------------------------------------


@dataclass
class _Update:
    """One adapter on one module, ready to add to a batch."""

    kind: str
    a: mx.array
    b: mx.array
    scale: float
    magnitude: mx.array | None = None
    """DoRA: m / ||W + scale (a b)^T||, per output row"""


@dataclass
class _Bank:
    selection: Selection
    base_class: type
    updates: dict[str, _Update] = field(default_factory=dict)


def _weight(module: Any) -> mx.array:
    if isinstance(module, nn.QuantizedLinear):
        return mx.dequantize(
            module.weight, module.scales, module.biases,
            group_size=module.group_size, bits=module.bits, mode=module.mode,
        )  # fmt: skip
    return module.weight


def _linear_update(bank: _Bank, module: Any, x: mx.array, y: mx.array, u: _Update) -> mx.array:
    z = (x @ u.a) @ u.b
    if u.magnitude is None:  # mlx-lm's LoRALinear
        return y + (u.scale * z).astype(x.dtype)
    # mlx-lm's DoRALinear: the base product without its bias, rescaled, then the bias
    out = x @ _weight(module).T + (u.scale * z).astype(x.dtype)
    out = u.magnitude.astype(x.dtype) * out
    return out + module.bias if "bias" in module else out


def _switch_update(
    x: mx.array, y: mx.array, u: _Update, indices: mx.array, sorted_indices: bool
) -> mx.array:
    # mlx-lm's LoRASwitchLinear
    z = mx.gather_mm(x, u.a.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
    z = mx.gather_mm(z, u.b.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
    return y + (u.scale * z).astype(x.dtype)


def _row_mask(bank: _Bank, name: str, y: mx.array, sorted_rows: bool) -> mx.array:
    flags = bank.selection.flags(name)
    if sorted_rows:
        routing = bank.selection.routing
        if routing is None:
            raise ValueError("an MoE expert layer ran sorted without its block's routing")
        # mlx-lm's sort: entry i is token order[i] // k of the flattened (rows, tokens) input
        k = routing.shape[-1]
        per_row = routing.size // (routing.shape[0] * k)
        order = mx.argsort(routing.flatten())
        flags = flags[(order // k) // per_row]
    elif y.shape[0] != len(bank.selection.rows):
        raise ValueError(
            f"a batch of {y.shape[0]} rows ran with {len(bank.selection.rows)} choices"
        )
    return flags.reshape(flags.shape + (1,) * (y.ndim - 1))


def _adapted_call(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> Any:
    bank: _Bank = self._mlxpp_bank
    y = bank.base_class.__call__(self, x, *args, **kwargs)
    rows = bank.selection.rows
    chosen = [n for n in dict.fromkeys(rows) if n is not None and n in bank.updates]
    if not chosen:
        return y
    switch = isinstance(self, _SWITCH)
    sorted_rows = bool(kwargs.get("sorted_indices", args[1] if len(args) > 1 else False))

    def update(name: str) -> mx.array:
        u = bank.updates[name]
        if switch:
            indices = kwargs["indices"] if "indices" in kwargs else args[0]
            return _switch_update(x, y, u, indices, sorted_rows)
        return _linear_update(bank, self, x, y, u)

    if len(set(rows)) == 1:  # every row runs the same adapter
        return update(chosen[0])
    out = y
    for name in chosen:
        out = mx.where(_row_mask(bank, name, y, sorted_rows and switch), update(name), out)
    return out


def _routing_call(self: Any, x: mx.array, indices: mx.array) -> Any:
    selection: Selection = self._mlxpp_selection
    selection.routing = indices
    try:
        return self._mlxpp_base_class.__call__(self, x, indices)
    finally:
        selection.routing = None


_CLASSES: dict[tuple[type, str], type] = {}


def _swapped(cls: type, call: Any) -> type:
    key = (cls, call.__name__)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Adapted{cls.__name__}", (cls,), {"__call__": call})
    return _CLASSES[key]


def _update_for(base: Any, weights: AdapterWeights, leaves: dict[str, mx.array], family: str,
                module: str) -> _Update:  # fmt: skip
    """The adapter's update on ``base``, checked by building mlx-lm's layer over it."""
    layer = _mlx_layer(base, weights, leaves, family, module)
    magnitude = None
    if weights.config.kind == "dora":
        w = layer._dequantized_weight()
        adapted = w + (layer.scale * layer.lora_b.T) @ layer.lora_a.T
        magnitude = layer.m / mx.linalg.norm(adapted, axis=1)
    update = _Update(weights.config.kind, layer.lora_a, layer.lora_b, layer.scale, magnitude)
    mx.eval(update.a, update.b, *(() if magnitude is None else (magnitude,)))
    return update


def add_named(
    model: nn.Module, name: str, weights: AdapterWeights, family: str, selection: Selection,
    replace: bool = False,
) -> int:  # fmt: skip
    """Load adapter ``name`` beside the others on ``model``'s modules; returns how many
    modules it adapts. All or nothing: a module it cannot adapt leaves the model as it was
    (``replace``: one of that name held before stays until the new one is known good)."""
    staged = []
    for module, leaves in sorted(weights.modules.items()):
        parent, key, base = _lookup(model, family, module)
        bank: _Bank | None = getattr(base, "_mlxpp_bank", None)
        plain = bank.base_class if bank is not None else type(base)
        if isinstance(base, _SWITCH):
            holder = _resolve(model, module.rsplit(".", 1)[0])[2]
            if not isinstance(holder, SwitchGLU | SwitchMLP):
                raise _refuse(family, module, base, "its MoE block is not mlx-lm's SwitchGLU")
        staged.append((module, base, plain, _update_for(base, weights, leaves, family, module)))
    if replace:
        remove_named(model, name)
    for module, base, plain, update in staged:
        bank = getattr(base, "_mlxpp_bank", None)
        if bank is None:
            bank = _Bank(selection, plain)
            object.__setattr__(base, "_mlxpp_bank", bank)
            base.__class__ = _swapped(plain, _adapted_call)
            if isinstance(base, _SWITCH):
                holder = _resolve(model, module.rsplit(".", 1)[0])[2]
                if not hasattr(holder, "_mlxpp_selection"):
                    object.__setattr__(holder, "_mlxpp_selection", selection)
                    object.__setattr__(holder, "_mlxpp_base_class", type(holder))
                    holder.__class__ = _swapped(type(holder), _routing_call)
        bank.updates[name] = update
    return len(staged)


def remove_named(model: nn.Module, name: str) -> int:
    """Drop adapter ``name`` from every module; a module left with none gets its own class
    back. Returns how many modules it was on."""
    count = 0
    for _, module in model.named_modules():
        bank: _Bank | None = getattr(module, "_mlxpp_bank", None)
        if bank is None or name not in bank.updates:
            continue
        del bank.updates[name]
        count += 1
        if not bank.updates:
            module.__class__ = bank.base_class
            object.__delattr__(module, "_mlxpp_bank")
    return count


def named_on(model: nn.Module) -> dict[str, int]:
    """Each per-request adapter on ``model`` and how many modules it adapts."""
    out: dict[str, int] = {}
    for _, module in model.named_modules():
        bank: _Bank | None = getattr(module, "_mlxpp_bank", None)
        for name in bank.updates if bank is not None else ():
            out[name] = out.get(name, 0) + 1
    return out
