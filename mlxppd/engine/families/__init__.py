"""Stage executors, one module per wire family, keyed by the config's ``model_type``.

Every family module exposes the same small contract (see ``FamilyModule``):
``WIRE_NAME``, ``MODEL_TYPES``, ``num_layers(config)`` and ``build_stage(config, spec)``, which
returns an ``nn.Module`` with ``make_cache()``, ``local_weight_name(global_name)`` and
``__call__(x, cache)``: token ids in on the first stage, hidden states otherwise; logits out of the
last stage, hidden states otherwise.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Protocol

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.stages import StageSpec

# wire family name -> module under mlxppd.engine.families
_FAMILY_MODULES = {
    "llama": "llama",
    "mistral": "llama",
}


class StageModel(Protocol):
    """What ``build_stage`` returns (an ``nn.Module`` in practice)."""

    def make_cache(self) -> list[Any]: ...

    def local_weight_name(self, name: str) -> str | None: ...

    def __call__(self, x: Any, cache: list[Any]) -> Any: ...


class FamilyModule(Protocol):
    WIRE_NAME: str
    MODEL_TYPES: tuple[str, ...]

    def num_layers(self, config: dict[str, Any]) -> int: ...

    def build_stage(self, config: dict[str, Any], spec: StageSpec) -> StageModel: ...


def supported_families() -> tuple[str, ...]:
    """The stable wire names of every family this build can run as pipeline stages."""
    return tuple(sorted(_FAMILY_MODULES))


def family_for(config: dict[str, Any]) -> FamilyModule:
    """The family module serving this config's ``model_type``."""
    model_type = config.get("model_type")
    module_name = _FAMILY_MODULES.get(str(model_type))
    if module_name is None:
        raise ConfigurationError(
            f"model_type {model_type!r} has no pipeline stage executor; supported families: "
            + ", ".join(supported_families()),
            source="config.json",
            key="model_type",
        )
    module: ModuleType = importlib.import_module(f"{__name__}.{module_name}")
    return module
