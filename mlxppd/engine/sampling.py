"""Per-request samplers: greedy, or mlx-lm's chain (top-p, min-p, top-k, then temperature)
drawing with the request's own random key; and mlx-lm's logits processors (logit bias,
repetition, presence and frequency penalties) over the sequence's own token history.

Requests share one process and one mlx thread, so a per-request seed cannot use mlx's global
random state: each sampler derives its own key for every draw. The key of a draw is a function
of (seed, position) alone, so a sequence replayed after a failover (its generated tokens
prefilled again, ``first_draw`` set to their count) draws exactly what it would have drawn.
The processors see the last prompt tokens (``SamplerSpec.context``) and then every token
sampled, as mlx-lm's ``generate_step`` feeds its processors; their window is 20 tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlxppd.core.protocol.sampling import PENALTY_CONTEXT, GrammarSpec, SamplerSpec
from mlxppd.engine.grammar import Constraint, GrammarCompiler

Sampler = Callable[[mx.array], mx.array]
#: the smallest top-p applied (what float32 still tells apart from 0)
_MIN_TOP_P = 1e-6
#: how many tokens of history the processors are given (their window, with room)
_HISTORY = 4 * PENALTY_CONTEXT


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def draw_key(seed: int, position: int) -> mx.array:
    """The PRNG key of draw ``position`` of a sequence seeded ``seed`` (both unsigned 64-bit)."""
    digest = hashlib.blake2b(
        seed.to_bytes(8, "little") + position.to_bytes(8, "little"), digest_size=8
    ).digest()
    return mx.random.key(int.from_bytes(digest, "little"))


class KeyedSampler:
    """mlx-lm's sampling chain in its order (top-p, min-p, top-k, then the temperature); draw
    ``n`` uses ``draw_key(seed, n)`` (unseeded: mlx's random state)."""

    def __init__(
        self,
        temperature: float,
        top_p: float,
        seed: int | None,
        first_draw: int = 0,
        *,
        top_k: int = 0,
        min_p: float = 0.0,
    ):
        self.temperature = temperature
        self.seed = seed
        self.position = first_draw
        self.methods: list[Callable[[mx.array], mx.array]] = []
        if 0 < top_p < 1:
            # A top-p that rounds to 0 in float32 would keep no token at all: keep the best one.
            self.methods.append(partial(apply_top_p, top_p=max(top_p, _MIN_TOP_P)))
        if min_p != 0.0:
            self.methods.append(partial(apply_min_p, min_p=min_p))
        self.top_k = top_k

    def __call__(self, logprobs: mx.array) -> mx.array:
        for method in self.methods:
            logprobs = method(logprobs)
        # A top-k of the vocabulary or more keeps every token: mlx-lm's would raise inside a
        # compiled function, which leaves mlx's random state broken for every later draw.
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        key = draw_key(self.seed, self.position) if self.seed is not None else None
        self.position += 1
        return mx.random.categorical(logprobs * (1 / self.temperature), key=key)


def make_sampler(
    temperature: float,
    top_p: float = 1.0,
    seed: int | None = None,
    first_draw: int = 0,
    *,
    top_k: int = 0,
    min_p: float = 0.0,
) -> Sampler:
    """Greedy at temperature 0 (what token parity is defined on), keyed sampling otherwise."""
    if temperature <= 0:
        return greedy
    if seed is not None and not 0 <= seed < 1 << 64:
        raise ValueError(f"a seed is an unsigned 64-bit integer, not {seed}")
    return KeyedSampler(temperature, top_p, seed, first_draw, top_k=top_k, min_p=min_p)


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None = None
    """the most likely tokens and their logprobs, most likely first (when asked for)"""


class SequenceSampler:
    """Everything between one sequence's logits and its next token, on the last stage."""

    def __init__(
        self,
        draw: Sampler,
        spec: SamplerSpec | None = None,
        vocab: int | None = None,
        constraint: Constraint | None = None,
    ):
        """``constraint``: the output's grammar (``engine/grammar.py``), applied last."""
        spec = spec or SamplerSpec()
        self.constraint = constraint
        if vocab is not None and any(t >= vocab for t, _ in spec.logit_bias):
            raise ValueError(f"logit_bias names a token id outside the vocabulary of {vocab}")
        self.draw = draw
        self.top_logprobs = spec.top_logprobs
        self.processors = make_logits_processors(
            logit_bias=dict(spec.logit_bias) or None,
            repetition_penalty=spec.repetition_penalty,
            presence_penalty=spec.presence_penalty or None,
            frequency_penalty=spec.frequency_penalty or None,
        )
        self.history = list(spec.context)

    def scores(self, logits: mx.array) -> mx.array:
        """Log-probabilities of one row of logits ([1, vocab]) after the processors."""
        if self.processors:
            tokens = mx.array(self.history, dtype=mx.int32)
            for processor in self.processors:
                logits = processor(tokens, logits)
        if self.constraint is not None:
            logits = self.constraint.apply(logits)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def sample(self, scores: mx.array, logprob: bool) -> Sampled:
        """The next token from one row of scores (evaluated here)."""
        token = self.draw(scores)
        top = None
        if self.top_logprobs:
            k = self.top_logprobs
            top = mx.argpartition(-scores[0], k - 1)[:k]
            mx.eval(token, scores, top)
        else:
            mx.eval(token, scores)
        value = cast(int, token.item())
        if self.constraint is not None:
            self.constraint.advance(value)
        if self.processors:
            self.history = [*self.history[-_HISTORY:], value]
        best = None
        if top is not None:
            ids = cast(list[int], top.tolist())
            pairs = [(i, cast(float, scores[0, i].item())) for i in ids]
            best = tuple(sorted(pairs, key=lambda p: -p[1]))
        chosen = cast(float, scores[0, value].item()) if logprob else None
        return Sampled(value, chosen, best)


GREEDY = SequenceSampler(greedy)


def sample_rows(logits: mx.array, samplers: list[SequenceSampler], logprob: bool) -> list[Sampled]:
    """The next token of each row of ``logits`` ([rows, vocab]) by its sampler, none of which
    has processors or a grammar: one normalization, one top-k for the rows reporting top
    logprobs, one evaluation (``SequenceSampler.sample`` row by row costs an evaluation per
    row and one per reported token)."""
    scores = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = mx.concatenate([s.draw(scores[i : i + 1]) for i, s in enumerate(samplers)])
    chosen = mx.take_along_axis(scores, tokens.reshape(-1, 1), axis=-1)
    k = max(s.top_logprobs for s in samplers)
    if k:
        top = mx.argpartition(-scores, k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(scores, top, axis=-1)
        mx.eval(tokens, chosen, top, values)
        top_ids = cast(list[list[int]], top.tolist())
        top_values = cast(list[list[float]], values.tolist())
    else:
        mx.eval(tokens, chosen)
    ids, picked = cast(list[int], tokens.tolist()), cast(list[list[float]], chosen.tolist())
    out = []
    for i, sampler in enumerate(samplers):
        best = None
        if sampler.top_logprobs:
            pairs = sorted(zip(top_ids[i], top_values[i], strict=True), key=lambda p: -p[1])
            best = tuple(pairs[: sampler.top_logprobs])
        out.append(Sampled(ids[i], picked[i][0] if logprob else None, best))
    return out


def constraint_for(grammar: GrammarSpec | None, tokenizer: Any, vocab: int) -> Constraint | None:
    """The matcher of a request's output grammar (None: unconstrained); ValueError names what
    is wrong with the schema."""
    if grammar is None:
        return None
    compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab)
    if grammar.kind == "json_object":
        return compiler.json_object()
    schema = json.loads(grammar.schema_text or "{}")
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema is an object")
    return compiler.json_schema(schema, strict=grammar.strict)
