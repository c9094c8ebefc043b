"""LoRA and DoRA adapters on a stage: read stage-locally, fused or kept apart per request."""

from mlxppd.engine.adapters.stage_adapters import (
    AdapterInfo,
    StageAdapters,
    attach_adapters,
    ensure_no_adapter,
)

__all__ = ["AdapterInfo", "StageAdapters", "attach_adapters", "ensure_no_adapter"]
