"""How a prompt is cut into prefill chunks (pure).

A chunk is one forward pass on each stage. Chunks flow through the stages back to back, so with
``k`` chunks on ``s`` stages stage 1 computes chunk ``i`` while stage 0 computes chunk ``i + 1``
and the prompt takes about ``(k + s - 1) / k`` of one stage's share of the work instead of
``s`` shares: more chunks fill the pipeline better, but a chunk of too few rows wastes the
matrix units. While other sequences decode, chunks are small, because a stage runs a waiting
decode step between two chunks (``runtime/pipeline/work_queue.py``) and a chunk's compute is
what those streams wait for.
"""

from __future__ import annotations

import math

#: mlx-lm's prefill step: one process (one stage) needs no more chunks than memory asks for
SINGLE_STAGE_CHUNK = 2048
#: chunks per stage a prompt is cut into when nothing else runs
CHUNKS_PER_STAGE = 4
#: the fewest and most rows of a pipelined chunk
MIN_CHUNK = 64
MAX_CHUNK = 512
#: rows of a chunk while other sequences decode: their steps wait at most one such chunk per
#: stage (bench/pipeline.py, 2 cores: inter-token p99/p50 about 2 at 16 rows, 3.9 at 32)
SHARED_CHUNK = 16


def prefill_chunk_size(
    prompt_tokens: int, stages: int, others_running: bool, override: int | None = None
) -> int:
    """Tokens per prefill chunk for a prompt of ``prompt_tokens`` on ``stages`` stages;
    ``override`` (``--prefill-chunk-size``) wins."""
    if override is not None:
        if override < 1:
            raise ValueError("a prefill chunk holds at least one token")
        return override
    if stages <= 1:
        return SINGLE_STAGE_CHUNK
    if others_running:
        return SHARED_CHUNK
    per_stage = math.ceil(prompt_tokens / (CHUNKS_PER_STAGE * stages))
    return max(MIN_CHUNK, min(MAX_CHUNK, per_stage))
