"""Qwen 3.5 (model_types ``qwen3_5`` and ``qwen3_5_moe``, flat or VLM config): recurrent.

mlx-lm builds both as ``Model`` -> ``language_model`` (a text model with ``model`` and an
optional ``lm_head``), whether the config nests the text part under ``text_config`` (the VLM
checkpoints; their sanitize drops the vision tower) or not. The blocks are Qwen3-Next's: gated
delta net or full attention by global index, so the stage logic is the same.
"""

from __future__ import annotations

import mlx.nn as nn

from mlxppd.engine.families.qwen3_next import Qwen3NextFamily


class Qwen35Family(Qwen3NextFamily):
    def lm(self, model: nn.Module) -> nn.Module:
        return model.language_model


FAMILY = Qwen35Family()
