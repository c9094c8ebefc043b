"""A seeded sampler's draw depends on (seed, position) alone, so a sequence replayed after a
failover (its tokens prefilled again, ``first_draw`` = how many it had drawn) draws the same."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxppd.engine.sampling import draw_key, greedy, make_sampler


def _draws(sampler, logits: mx.array, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(sampler(logits).item()) for _ in range(n)]


def test_a_replayed_sampler_continues_the_same_draws() -> None:
    logits = mx.log(mx.softmax(mx.arange(32, dtype=mx.float32) / 8))[None]
    whole = _draws(make_sampler(0.8, 1.0, seed=1234), logits, 12)
    resumed = _draws(make_sampler(0.8, 1.0, seed=1234, first_draw=7), logits, 5)
    assert resumed == whole[7:]
    assert len(set(whole)) > 1  # really sampling, not stuck on one token
    assert _draws(make_sampler(0.8, 1.0, seed=99), logits, 12) != whole


def test_draw_keys_differ_by_seed_and_position() -> None:
    keys = {tuple(draw_key(seed, pos).tolist()) for seed in (0, 1, 2**64 - 1) for pos in range(4)}
    assert len(keys) == 12


def test_greedy_stays_greedy_and_a_bad_seed_is_refused() -> None:
    assert make_sampler(0.0, 1.0, seed=5) is greedy
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        make_sampler(0.5, 1.0, seed=-1)


def test_a_top_k_beyond_the_vocabulary_keeps_every_token_and_breaks_nothing() -> None:
    import mlx.core as mx

    from mlxppd.engine.sampling import make_sampler

    logprobs = mx.log(mx.softmax(mx.arange(16, dtype=mx.float32)[None] / 4, axis=-1))
    wide = make_sampler(1.0, top_k=1 << 20, seed=5)(logprobs)
    assert wide.item() == make_sampler(1.0, seed=5)(logprobs).item()  # top-k off: same draw
    # mlx's random state still works afterwards (mlx-lm's own top-k raising would break it).
    assert make_sampler(1.0)(logprobs).size == 1
    tiny = make_sampler(1.0, top_p=5e-324, seed=5)(logprobs)  # a top-p that rounds to 0
    assert tiny.item() == 15  # keeps the most likely token
