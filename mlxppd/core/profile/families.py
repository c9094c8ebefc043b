"""The one table of model families, keyed by config.json's ``model_type``.

A row says everything the rest of the code needs about a family: the name a node advertises in
the cluster handshake (and its VLM variant), which stage executor runs it as pipeline stages (or
why it runs single-process only), and how the profile prices its weights from config.json.

This module is pure data: an executor is named by its module and attribute under
``mlxppd.engine.families``, which imports it only when a model of that family is used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mlxppd.core.profile.builders import (
    gemma3,
    gemma4,
    glm4,
    glm4_moe,
    gpt_oss,
    llama,
    llama4,
    llama4_text,
    mixtral,
    qwen3,
)
from mlxppd.core.profile.mla import deepseek_v3, glm4_moe_lite, glm_moe_dsa, kimi_k3
from mlxppd.core.profile.pricing import Layout, Pricer
from mlxppd.core.profile.recurrent import jamba, nemotron_h, qwen3_5, qwen3_next

__all__ = ["FAMILIES", "FamilyBuilder", "FamilySpec"]

#: a layout builder mirroring mlx-lm's model class (``core/profile_*.py``)
FamilyBuilder = Callable[[Mapping[str, Any], Pricer], Layout]


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """One ``model_type``: its wire name, its stage executor and its profile builder."""

    model_type: str
    #: the wire family name advertised in the cluster handshake
    wire: str
    #: the wire name of a VLM checkpoint (``vision_config`` in config.json) sharing model_type
    vlm_wire: str | None = None
    #: module under ``mlxppd.engine.families`` running it as stages (None: no stage executor)
    executor: str | None = None
    #: the attribute of that module holding the ``Family`` instance
    executor_attr: str = "FAMILY"
    #: why it runs single-process only (refused for --pp-size / --pp-layers); None: it splits
    single_process: str | None = None
    #: prices its blocks from config.json
    profile: FamilyBuilder

    def __post_init__(self) -> None:
        if self.executor is not None and self.single_process is not None:
            raise ValueError(f"{self.model_type}: a stage executor or single-process, not both")

    @property
    def runs_as_stages(self) -> bool:
        return self.executor is not None

    @property
    def runnable(self) -> bool:
        """Served at all: as pipeline stages, or whole in one process."""
        return self.executor is not None or self.single_process is not None


_SPECS: tuple[FamilySpec, ...] = (
    FamilySpec(model_type="llama", wire="llama", executor="llama", profile=llama),
    # mlx-lm loads mistral with llama.py
    FamilySpec(model_type="mistral", wire="mistral", executor="llama", profile=llama),
    FamilySpec(model_type="mixtral", wire="mixtral", executor="mixtral", profile=mixtral),
    FamilySpec(
        model_type="deepseek_v3", wire="deepseek_v3", executor="deepseek_v3", profile=deepseek_v3
    ),
    # mlx-lm remaps kimi_k2 to deepseek_v3: priced by that layout, no stage executor here yet
    FamilySpec(model_type="kimi_k2", wire="kimi_k2", profile=deepseek_v3),
    FamilySpec(model_type="llama4", wire="llama4", executor="llama4", profile=llama4),
    FamilySpec(
        model_type="llama4_text",
        wire="llama4",
        executor="llama4",
        executor_attr="TEXT",
        profile=llama4_text,
    ),
    FamilySpec(model_type="gpt_oss", wire="gpt_oss", executor="gpt_oss", profile=gpt_oss),
    FamilySpec(model_type="gemma3_text", wire="gemma3", executor="gemma3", profile=gemma3),
    FamilySpec(
        model_type="gemma3", wire="gemma3", executor="gemma3", executor_attr="VLM", profile=gemma3
    ),
    FamilySpec(model_type="glm4", wire="glm4", executor="glm4", profile=glm4),
    FamilySpec(model_type="glm4_moe", wire="glm4_moe", executor="glm4", profile=glm4_moe),
    FamilySpec(
        model_type="glm4_moe_lite",
        wire="glm4_moe_lite",
        executor="glm4",
        executor_attr="LITE",
        profile=glm4_moe_lite,
    ),
    FamilySpec(
        model_type="glm_moe_dsa", wire="glm_moe_dsa", executor="glm_moe_dsa", profile=glm_moe_dsa
    ),
    FamilySpec(model_type="qwen3", wire="qwen3", executor="qwen3", profile=qwen3),
    FamilySpec(model_type="gemma4_text", wire="gemma4", executor="gemma4", profile=gemma4),
    FamilySpec(model_type="gemma4", wire="gemma4_vlm", executor="gemma4", profile=gemma4),
    FamilySpec(
        model_type="qwen3_5",
        wire="qwen3_5",
        vlm_wire="qwen3_5_vlm",
        executor="qwen3_5",
        profile=qwen3_5,
    ),
    FamilySpec(
        model_type="qwen3_5_moe",
        wire="qwen3_5_moe",
        vlm_wire="qwen3_5_moe_vlm",
        executor="qwen3_5",
        profile=qwen3_5,
    ),
    FamilySpec(
        model_type="qwen3_next", wire="qwen3_next", executor="qwen3_next", profile=qwen3_next
    ),
    FamilySpec(model_type="jamba", wire="jamba", executor="jamba", profile=jamba),
    FamilySpec(
        model_type="nemotron_h", wire="nemotron_h", executor="nemotron_h", profile=nemotron_h
    ),
    FamilySpec(
        model_type="kimi_k3",
        wire="kimi_k3",
        single_process=(
            "kimi_k3 has no pipeline stage executor: its layers cannot be split across stages; "
            "drop --pp-size/--pp-layers to run it in one process"
        ),
        profile=kimi_k3,
    ),
)

#: model_type -> its spec
FAMILIES: Mapping[str, FamilySpec] = MappingProxyType({s.model_type: s for s in _SPECS})
if len(FAMILIES) != len(_SPECS):  # pragma: no cover - a duplicated row
    raise ValueError("a model_type appears twice in the family table")
