"""Stage executors, one module per wire family, keyed by the config's ``model_type``.

Each family module exposes ``FAMILY``, an instance of ``base.Family`` (the small contract:
``num_layers``, ``check_split``, ``prune``, ``make_cache``, ``embed``, ``run_layers``, ``head``).
The table below is the one place that maps a ``model_type`` to its wire family name and module;
modules are imported only when a model of that family is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from mlxppd.core.errors import ConfigurationError
from mlxppd.engine.families.base import Family

# model_type -> (wire family name, module under mlxppd.engine.families[:attribute, default FAMILY])
_MODEL_TYPES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "llama"),
    "mistral": ("mistral", "llama"),
    "mixtral": ("mixtral", "mixtral"),
    "deepseek_v3": ("deepseek_v3", "deepseek_v3"),
    "llama4": ("llama4", "llama4"),
    "llama4_text": ("llama4", "llama4:TEXT"),
    "gpt_oss": ("gpt_oss", "gpt_oss"),
    "gemma3_text": ("gemma3", "gemma3"),
    "gemma3": ("gemma3", "gemma3:VLM"),
    "glm4": ("glm4", "glm4"),
    "glm4_moe": ("glm4_moe", "glm4"),
    "glm4_moe_lite": ("glm4_moe_lite", "glm4:LITE"),
    "glm_moe_dsa": ("glm_moe_dsa", "glm_moe_dsa"),
    "qwen3": ("qwen3", "qwen3"),
    "gemma4_text": ("gemma4", "gemma4"),
    "gemma4": ("gemma4_vlm", "gemma4"),
    "qwen3_5": ("qwen3_5", "qwen3_5"),
    "qwen3_5_moe": ("qwen3_5_moe", "qwen3_5"),
    "qwen3_next": ("qwen3_next", "qwen3_next"),
    "jamba": ("jamba", "jamba"),
    "nemotron_h": ("nemotron_h", "nemotron_h"),
}

# A VLM checkpoint of these shares the model_type; its text path advertises its own wire name.
_VLM_WIRE_NAMES: dict[str, str] = {
    "qwen3_5": "qwen3_5_vlm",
    "qwen3_5_moe": "qwen3_5_moe_vlm",
}

# model_type -> why it runs single-process only (refused for --pp-size / --pp-layers)
_SINGLE_PROCESS_ONLY: dict[str, str] = {
    "kimi_k3": (
        "kimi_k3 has no pipeline stage executor: its layers cannot be split across stages; "
        "drop --pp-size/--pp-layers to run it in one process"
    ),
}


def supported_families() -> tuple[str, ...]:
    """The stable wire names of every family this build can run as pipeline stages."""
    wire_names = {wire for wire, _ in _MODEL_TYPES.values()} | set(_VLM_WIRE_NAMES.values())
    return tuple(sorted(wire_names))


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_MODEL_TYPES))


def wire_family(config: dict[str, Any]) -> str:
    """The wire family name a model advertises in the cluster handshake."""
    wire = _entry(config)[0]
    if "vision_config" in config:
        return _VLM_WIRE_NAMES.get(str(config.get("model_type")), wire)
    return wire


def single_process_reason(config: dict[str, Any]) -> str | None:
    """Why this model cannot be split into stages, or None when it can."""
    return _SINGLE_PROCESS_ONLY.get(str(config.get("model_type")))


def _entry(config: dict[str, Any]) -> tuple[str, str]:
    model_type = str(config.get("model_type"))
    if model_type in _SINGLE_PROCESS_ONLY:
        return (model_type, "whole:FAMILY")
    entry = _MODEL_TYPES.get(model_type)
    if entry is None:
        raise ConfigurationError(
            f"model_type {model_type!r} has no pipeline stage executor; supported families: "
            + ", ".join(supported_families()),
            source="config.json",
            key="model_type",
        )
    return entry


def family_for(config: dict[str, Any]) -> Family:
    """The family serving this config's ``model_type``."""
    module_name, _, attribute = _entry(config)[1].partition(":")
    module = importlib.import_module(f"{__name__}.{module_name}")
    family: Family = getattr(module, attribute or "FAMILY")
    return family
