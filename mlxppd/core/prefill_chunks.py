"""How a prompt is cut into prefill chunks (pure).

A chunk is one forward pass on each stage. Chunks flow through the stages back to back, so with
``k`` chunks on ``s`` stages stage 1 computes chunk ``i`` while stage 0 computes chunk ``i + 1``
and the prompt takes about ``(k + s - 1) / k`` of one stage's share of the work instead of
``s`` shares: more chunks fill the pipeline better, but a chunk of too few rows wastes the
matrix units. While other sequences decode, chunks are small, because a stage runs a waiting
decode step between two chunks (``runtime/stage/work_queue.py``) and a chunk's compute is
what those streams wait for.

Both sizes follow the pipeline's measured speed once there is some (:class:`PipelineSpeed`):
a chunk of ``r`` rows costs about what one decode pass costs when ``r`` is the ratio of a
stage's decode pass to its prefill time per token. While others decode, a chunk is ``r`` rows
(their next token waits at most about one extra pass per stage); alone, a chunk is at least
``4 r`` rows, so a pass's fixed cost (reading every weight once) stays a small part of it.
On this 2-core CPU the coordinator measured 4.0-4.4 ms per prompt token and 76-87 ms per
2-stage decode step, so ``r`` is 9-10; on a GPU, where a prefill token costs far less than a
pass, it is in the hundreds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

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
#: the fewest rows of a chunk while others decode, however fast prefill is measured
MIN_SHARED_CHUNK = 4
#: a prompt shorter than this says more about a pass's fixed cost than about prefill speed
MIN_TIMED_PROMPT = 256
#: weight of the newest measurement in the running averages
SMOOTHING = 0.2


@dataclass(frozen=True)
class PipelineSpeed:
    """What the coordinator measured of its pipeline; 0 means not measured yet."""

    prefill_s_per_token: float = 0.0
    """seconds to first token per prompt token, for prompts prefilled with nothing else running"""
    decode_step_s: float = 0.0
    """seconds between two tokens of a decoding stream (one pass on every stage)"""

    def prefilled(self, prompt_tokens: int, seconds: float) -> PipelineSpeed:
        """After a prompt of ``prompt_tokens`` was prefilled alone in ``seconds``."""
        if prompt_tokens < MIN_TIMED_PROMPT or seconds <= 0:
            return self
        return replace(
            self, prefill_s_per_token=_mean(self.prefill_s_per_token, seconds / prompt_tokens)
        )

    def stepped(self, seconds: float) -> PipelineSpeed:
        """After a stream got its next token ``seconds`` after the one before."""
        if seconds <= 0:
            return self
        return replace(self, decode_step_s=_mean(self.decode_step_s, seconds))

    def pass_rows(self, stages: int) -> float | None:
        """Prompt rows whose prefill costs what one stage's decode pass does (None: unknown)."""
        if self.prefill_s_per_token <= 0 or self.decode_step_s <= 0:
            return None
        return self.decode_step_s / max(1, stages) / self.prefill_s_per_token


def _mean(old: float, new: float) -> float:
    return new if old <= 0 else old + SMOOTHING * (new - old)


def prefill_chunk_size(
    prompt_tokens: int,
    stages: int,
    others_running: bool,
    override: int | None = None,
    speed: PipelineSpeed | None = None,
) -> int:
    """Tokens per prefill chunk for a prompt of ``prompt_tokens`` on ``stages`` stages, sized
    from ``speed`` where it was measured; ``override`` (``--prefill-chunk-size``) wins."""
    if override is not None:
        if override < 1:
            raise ValueError("a prefill chunk holds at least one token")
        return override
    if stages <= 1:
        return SINGLE_STAGE_CHUNK
    rows = speed.pass_rows(stages) if speed is not None else None
    if others_running:
        if rows is None:
            return SHARED_CHUNK
        return max(MIN_SHARED_CHUNK, min(MAX_CHUNK, round(rows)))
    fewest = MIN_CHUNK if rows is None else max(MIN_CHUNK, min(SINGLE_STAGE_CHUNK, round(4 * rows)))
    per_stage = math.ceil(prompt_tokens / (CHUNKS_PER_STAGE * stages))
    return max(fewest, min(max(MAX_CHUNK, fewest), per_stage))
