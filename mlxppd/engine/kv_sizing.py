"""How many KV-cache bytes one token costs on a stage, measured by a probe forward.

Measuring beats a per-family formula: whatever the stage's caches are (full, rotating, MLA
latents, SSM state), one probe token through the real layers shows what each layer stores.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxppd.engine.stage import LoadedStage


def _arrays(state: Any) -> list[mx.array]:
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for item in state for a in _arrays(item)]
    return []


def kv_bytes_per_token(stage: LoadedStage, hidden_size: int) -> int:
    """Bytes one more token adds to this stage's caches (fixed-size state counted as 0)."""
    sizes = []
    for tokens in (1, 2):
        cache = stage.make_cache()
        if stage.spec.has_embedding:
            x = mx.zeros((1, tokens), dtype=mx.uint32)
        else:
            x = mx.zeros((1, tokens, hidden_size), dtype=mx.float16)
        stage(x, cache)
        total = 0
        for c in cache:
            for a in _arrays(c.state):
                mx.eval(a)
                # Preallocated caches keep room for many tokens; count the used rows only.
                per_row = a.nbytes // a.shape[2] if a.ndim == 4 and a.shape[2] > 0 else 0
                total += per_row * tokens if per_row else 0
        sizes.append(total)
    return max(sizes[1] - sizes[0], 1)
