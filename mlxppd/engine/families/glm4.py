"""GLM4 family: dense ``glm4``, MoE ``glm4_moe`` and the MLA-based ``glm4_moe_lite``.

``glm4_moe_lite`` builds its prefill causal mask as an explicit array (its MLA attention needs
it), so that model type gets its own instance.
"""

from __future__ import annotations

from mlxppd.engine.families.base import Family


class Glm4MoeLiteFamily(Family):
    MASK_AS_ARRAY = True


FAMILY = Family()
LITE = Glm4MoeLiteFamily()
