"""Per-request samplers: greedy, or temperature + top-p with the request's own random key.

Requests share one process and one mlx thread, so a per-request seed cannot use mlx's global
random state: each sampler derives its own key for every draw. The key of a draw is a function
of (seed, position) alone, so a sequence replayed after a failover (its generated tokens
prefilled again, ``first_draw`` set to their count) draws exactly what it would have drawn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def draw_key(seed: int, position: int) -> mx.array:
    """The PRNG key of draw ``position`` of a sequence seeded ``seed`` (both unsigned 64-bit)."""
    digest = hashlib.blake2b(
        seed.to_bytes(8, "little") + position.to_bytes(8, "little"), digest_size=8
    ).digest()
    return mx.random.key(int.from_bytes(digest, "little"))


class KeyedSampler:
    """Temperature / top-p sampling; draw ``n`` uses ``draw_key(seed, n)`` (unseeded: mlx's)."""

    def __init__(self, temperature: float, top_p: float, seed: int | None, first_draw: int = 0):
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.position = first_draw

    def __call__(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        key = draw_key(self.seed, self.position) if self.seed is not None else None
        self.position += 1
        return mx.random.categorical(logprobs * (1 / self.temperature), key=key)


def make_sampler(
    temperature: float, top_p: float = 1.0, seed: int | None = None, first_draw: int = 0
) -> Sampler:
    """Greedy at temperature 0 (what token parity is defined on), keyed sampling otherwise."""
    if temperature <= 0:
        return greedy
    if seed is not None and not 0 <= seed < 1 << 64:
        raise ValueError(f"a seed is an unsigned 64-bit integer, not {seed}")
    return KeyedSampler(temperature, top_p, seed, first_draw)
