"""Stage executors, one module per wire family, keyed by the config's ``model_type``.

Each family module exposes ``FAMILY``, an instance of ``base.Family`` (the small contract:
``num_layers``, ``check_split``, ``prune``, ``make_cache``, ``embed``, ``run_layers``, ``head``).
Which ``model_type`` runs on which module, under which wire name, is the family table in
``mlxppd.core.profile.families``; modules are imported only when a model of that family is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.profile.families import FAMILIES, FamilySpec
from mlxppd.engine.families.base import Family

# runs a single-process-only family: mlx-lm's whole model as one stage
_WHOLE_MODEL = ("whole", "FAMILY")


def supported_families() -> tuple[str, ...]:
    """The stable wire names of every family this build can run as pipeline stages."""
    wire_names: set[str] = set()
    for spec in FAMILIES.values():
        if spec.runs_as_stages:
            wire_names.add(spec.wire)
            if spec.vlm_wire is not None:
                wire_names.add(spec.vlm_wire)
    return tuple(sorted(wire_names))


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(t for t, spec in FAMILIES.items() if spec.runs_as_stages))


def wire_family(config: dict[str, Any]) -> str:
    """The wire family name a model advertises in the cluster handshake."""
    spec = _spec(config)
    if "vision_config" in config and spec.vlm_wire is not None:
        return spec.vlm_wire
    return spec.wire


def single_process_reason(config: dict[str, Any]) -> str | None:
    """Why this model cannot be split into stages, or None when it can."""
    spec = FAMILIES.get(str(config.get("model_type")))
    return spec.single_process if spec is not None else None


def _spec(config: dict[str, Any]) -> FamilySpec:
    """The spec of a family this build can serve (as stages or single-process)."""
    model_type = str(config.get("model_type"))
    spec = FAMILIES.get(model_type)
    if spec is None or not spec.runnable:
        raise ConfigurationError(
            f"model_type {model_type!r} has no pipeline stage executor; supported families: "
            + ", ".join(supported_families()),
            source="config.json",
            key="model_type",
        )
    return spec


def family_for(config: dict[str, Any]) -> Family:
    """The family serving this config's ``model_type``."""
    spec = _spec(config)
    module_name, attribute = (
        (spec.executor, spec.executor_attr) if spec.executor is not None else _WHOLE_MODEL
    )
    module = importlib.import_module(f"{__name__}.{module_name}")
    family: Family = getattr(module, attribute)
    return family
