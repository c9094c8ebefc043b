"""Loading one stage's layers and sizing its KV accounting (shared by serve and the agent)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxppd.core.kv_admission import StageKvManager
from mlxppd.core.stages import StageSpec
from mlxppd.engine.families.base import text_config
from mlxppd.engine.kv_sizing import kv_bytes_per_token
from mlxppd.engine.stage import load_stage
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.runtime.mlx_thread import MlxThread

#: a KV budget that never binds (no budget configured)
UNLIMITED_BYTES = 1 << 62


async def load_stage_runner(
    mlx: MlxThread, model_dir: Path, spec: StageSpec, config: dict[str, Any]
) -> tuple[StageRunner, int]:
    """The stage's runner and its KV bytes per token, loaded on the mlx thread."""

    def load() -> tuple[StageRunner, int]:
        stage = load_stage(model_dir, spec, config)
        per_token = kv_bytes_per_token(stage, int(text_config(config)["hidden_size"]))
        return StageRunner(stage), per_token

    return await mlx.run(load)


def stage_kv_manager(
    spec: StageSpec, bytes_per_token: int, budget_bytes: int | None, max_sequences: int
) -> StageKvManager:
    return StageKvManager(
        stage_index=spec.index,
        budget_bytes=budget_bytes or UNLIMITED_BYTES,
        bytes_per_token=bytes_per_token,
        max_sequences=max_sequences,
    )
