"""Per-request samplers: greedy, or temperature + top-p with the request's own random key.

Requests share one process and one mlx thread, so a per-request seed cannot use mlx's global
random state: each sampler carries its own key and splits it once per token.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class KeyedSampler:
    """Temperature / top-p sampling driven by an explicit PRNG key (reproducible per seed)."""

    def __init__(self, temperature: float, top_p: float, seed: int | None):
        self.temperature = temperature
        self.top_p = top_p
        self._key = mx.random.key(seed) if seed is not None else None

    def __call__(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        key = None
        if self._key is not None:
            self._key, key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1 / self.temperature), key=key)


def make_sampler(temperature: float, top_p: float = 1.0, seed: int | None = None) -> Sampler:
    """Greedy at temperature 0 (what token parity is defined on), keyed sampling otherwise."""
    if temperature <= 0:
        return greedy
    return KeyedSampler(temperature, top_p, seed)
