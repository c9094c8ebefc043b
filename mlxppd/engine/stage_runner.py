"""One stage's per-sequence state and compute, run on the process's mlx thread.

A sequence's KV caches live here from its first forward until it is released. The last stage
also holds each sequence's sampler, samples from the last position and returns only the token
(and its logprob when asked): logits and hidden states never go back to the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from mlxppd.engine.sampling import Sampler, greedy, make_sampler
from mlxppd.engine.stage import LoadedStage


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float | None


class StageRunner:
    def __init__(self, stage: LoadedStage):
        self.stage = stage
        self._caches: dict[str, list[Any]] = {}
        self._samplers: dict[str, Sampler] = {}

    @property
    def active(self) -> int:
        return len(self._caches)

    def set_sampling(self, seq: str, temperature: float, top_p: float, seed: int | None) -> None:
        self._samplers[seq] = make_sampler(temperature, top_p, seed)

    def forward(self, seq: str, x: mx.array) -> mx.array:
        """Run this stage's layers for one sequence; the output is evaluated."""
        cache = self._caches.get(seq)
        if cache is None:
            cache = self._caches[seq] = self.stage.make_cache()
        out = self.stage(x, cache)
        mx.eval(out)
        return out

    def forward_and_sample(self, seq: str, x: mx.array, logprobs: bool) -> Sampled:
        """Last stage: forward, then sample the next token from the last position."""
        cache = self._caches.get(seq)
        if cache is None:
            cache = self._caches[seq] = self.stage.make_cache()
        logits = self.stage(x, cache)[:, -1, :]
        scores = logits - mx.logsumexp(logits, keepdims=True)
        token = self._samplers.get(seq, greedy)(scores)
        mx.eval(token, scores)
        value = cast(int, token.item())
        logprob = cast(float, scores[0, value].item()) if logprobs else None
        return Sampled(value, logprob)

    def release_all(self) -> None:
        self._samplers.clear()
        self._caches.clear()

    def release(self, seq: str) -> bool:
        self._samplers.pop(seq, None)
        return self._caches.pop(seq, None) is not None
