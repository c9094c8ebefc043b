"""In-process pipeline: every stage in one process, each with its own module and KV caches.

The decode loop mirrors mlx-lm's ``generate_step`` (prefill all but the last prompt token in
chunks, then one step per token, the next step queued with ``async_eval`` before the current
token is read) so that greedy output is token-identical to single-process mlx-lm.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from mlxppd.engine.sampling import (  # noqa: F401  (make_sampler: re-export)
    Sampler,
    SequenceSampler,
    greedy,
    make_sampler,
)
from mlxppd.engine.stage import LoadedStage

PREFILL_STEP_SIZE = 2048


@dataclass(frozen=True)
class StepOutput:
    token: int
    #: log-probability of ``token``; None unless asked for (reading it costs a sync per token)
    logprob: float | None = None
    #: the most likely tokens and their logprobs (top_logprobs), most likely first
    top: tuple[tuple[int, float], ...] | None = None


class InProcessPipeline:
    """Stages run back to back; activations pass between them as arrays."""

    def __init__(self, stages: Sequence[LoadedStage]):
        if not stages or not stages[0].spec.has_embedding or not stages[-1].spec.has_lm_head:
            raise ValueError("a pipeline needs stages from the embedding to the lm_head")
        self.stages = list(stages)

    def vocab_size(self) -> int | None:
        """The output head's width (the logits' last dimension), from the model's config."""
        vocab = self.stages[-1].config.get("vocab_size")
        return vocab if isinstance(vocab, int) else None

    def make_caches(self) -> list[list[Any]]:
        return [stage.make_cache() for stage in self.stages]

    def forward(self, tokens: mx.array, caches: list[list[Any]]) -> mx.array:
        h = tokens
        for stage, cache in zip(self.stages, caches, strict=True):
            h = stage(h, cache)
        return h

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampler: Sampler = greedy,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        with_logprobs: bool = False,
    ) -> Iterator[StepOutput]:
        """Yield sampled tokens one by one; the caller stops early (e.g. on EOS) by breaking."""
        if not prompt:
            raise ValueError("the prompt is empty")
        caches = self.make_caches()
        remaining = mx.array(list(prompt), dtype=mx.uint32)

        def step(y: mx.array) -> tuple[mx.array, mx.array]:
            logits = self.forward(y[None], caches)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs), logprobs.squeeze(0)

        while remaining.size > 1:
            n = min(prefill_step_size, remaining.size - 1)
            self.forward(remaining[:n][None], caches)
            mx.eval([c.state for stage_cache in caches for c in stage_cache])
            remaining = remaining[n:]

        y, logprobs = step(remaining)
        mx.async_eval(y, logprobs)
        produced = 0
        while produced < max_tokens:
            if produced + 1 < max_tokens:
                next_y, next_logprobs = step(y)
                mx.async_eval(next_y, next_logprobs)
            token = cast(int, y.item())
            logprob = cast(float, logprobs[token].item()) if with_logprobs else None
            yield StepOutput(token=token, logprob=logprob)
            produced += 1
            if produced < max_tokens:
                y, logprobs = next_y, next_logprobs

    def generate_with(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampler: SequenceSampler,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        with_logprobs: bool = False,
    ) -> Iterator[StepOutput]:
        """``generate`` for a sampler whose processors need each token before the next step
        (penalties, logit bias) or that reports top logprobs: one step at a time."""
        if not prompt:
            raise ValueError("the prompt is empty")
        caches = self.make_caches()
        remaining = mx.array(list(prompt), dtype=mx.uint32)
        while remaining.size > 1:
            n = min(prefill_step_size, remaining.size - 1)
            self.forward(remaining[:n][None], caches)
            mx.eval([c.state for stage_cache in caches for c in stage_cache])
            remaining = remaining[n:]
        y = remaining
        for _ in range(max_tokens):
            logits = self.forward(y[None], caches)[:, -1, :]
            sampled = sampler.sample(sampler.scores(logits), with_logprobs)
            yield StepOutput(sampled.token, sampled.logprob, sampled.top)
            y = mx.array([sampled.token], dtype=mx.uint32)
