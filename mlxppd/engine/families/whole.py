"""Families that run single-process only (kimi_k3): mlx-lm's whole model as one stage.

Splitting is refused before anything loads; a single stage simply calls the full model, so
generation matches mlx-lm by construction.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import Family


class WholeModelFamily(Family):
    def check_split(self, config: dict[str, Any], spec: StageSpec) -> None:
        if spec.num_stages > 1:
            from mlxppd.engine.families import single_process_reason

            raise ConfigurationError(
                single_process_reason(config) or "this model cannot be split into stages",
                source="--pp-size/--pp-layers",
            )

    def prune(self, model: nn.Module, spec: StageSpec) -> None:
        """A single stage owns everything."""

    def make_cache(self, model: nn.Module, spec: StageSpec) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return list(make_prompt_cache(model))

    def embed(self, model: nn.Module, tokens: mx.array) -> mx.array:
        return tokens

    def run_layers(
        self, model: nn.Module, h: mx.array, cache: list[Any], spec: StageSpec
    ) -> mx.array:
        return model(h, cache=cache)

    def head(self, model: nn.Module, h: mx.array) -> mx.array:
        return h


FAMILY = WholeModelFamily()
