"""DeepSeek V3: MLA attention (explicit mask array) and routed MoE after the first dense blocks.

mlx-lm's ``sanitize`` stacks the per-expert tensors and drops the MTP block at index
``num_hidden_layers``; it runs once over the whole lazy weight map before the stage keeps its own
tensors, so every stage sees the same stacks and the block count is the one mlx-lm builds.
"""

from __future__ import annotations

from mlxppd.engine.families.base import Family


class DeepseekV3Family(Family):
    MASK_AS_ARRAY = True


FAMILY = DeepseekV3Family()
