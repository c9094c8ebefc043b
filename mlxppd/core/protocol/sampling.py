"""How the last stage samples one sequence beyond temperature, top-p and the seed (those ride
on ``Admit`` itself): the knobs of mlx-lm's own sampler and logits processors, sent as the JSON
payload of the last stage's ``Admit`` (a ``logit_bias`` of 300 entries does not fit in message
metadata). The sampler runs on the last stage; only token ids travel back.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from mlxppd.core.strict import StrictModel

#: tokens of context mlx-lm's penalties look at (its default for each of them)
PENALTY_CONTEXT = 20
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
#: bytes of a JSON schema a request may constrain its output to
MAX_SCHEMA_BYTES = 64 * 1024
#: tokens a replayed constrained sequence may carry for its grammar to follow (``replay``)
MAX_REPLAY_TOKENS = 32 * 1024
#: bytes of a SamplerSpec payload: 1024 biases take about 30 KiB, a schema at most 64 KiB (more
#: once escaped), a replay at most 11 bytes a token
MAX_SPEC_BYTES = 160 * 1024 + 11 * MAX_REPLAY_TOKENS

TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class GrammarSpec(StrictModel):
    """Output constrained to JSON (``engine/grammar.py`` on the last stage)."""

    kind: Literal["json_object", "json_schema"]
    schema_text: str | None = Field(
        None, max_length=MAX_SCHEMA_BYTES, description="json_schema: the schema, as JSON text"
    )
    strict: bool = True


class SamplerSpec(StrictModel):
    """The last stage's sampler for one sequence, as mlx-lm's ``make_sampler`` and
    ``make_logits_processors`` take it."""

    top_k: int = Field(0, ge=0, le=1 << 24, description="keep the k most likely tokens (0: all)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top one")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=100.0, description="multiplicative, over the last 20 tokens (None: off)"
    )
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="additive, last 20 tokens")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="per occurrence, last 20")
    logit_bias: list[tuple[TokenId, Bias]] = Field(
        default_factory=list, max_length=MAX_LOGIT_BIAS, description="(token id, added logit)"
    )
    top_logprobs: int = Field(
        0, ge=0, le=MAX_TOP_LOGPROBS, description="the most likely tokens to report each step"
    )
    context: list[TokenId] = Field(
        default_factory=list,
        max_length=PENALTY_CONTEXT,
        description="the prompt's last tokens, which the penalties count as mlx-lm's do",
    )
    grammar: GrammarSpec | None = Field(None, description="constrain the output to JSON")
    replay: list[TokenId] = Field(
        default_factory=list,
        max_length=MAX_REPLAY_TOKENS,
        description="a replayed sequence's tokens sent before the failover (as many as its "
        "first_draw): its grammar follows them before the next draw, which the last stage "
        "never saw, since they are prefilled through stage 0",
    )

    @property
    def penalizes(self) -> bool:
        """Whether any logits processor applies (the token history is then kept)."""
        return bool(
            self.logit_bias
            or self.repetition_penalty is not None
            or self.presence_penalty
            or self.frequency_penalty
        )


_SPEC: TypeAdapter[SamplerSpec] = TypeAdapter(SamplerSpec)


def parse_sampler_spec(payload: bytes) -> SamplerSpec:
    """An Admit's payload as its sampler (ValueError, or pydantic's, when bad)."""
    if len(payload) > MAX_SPEC_BYTES:
        raise ValueError(f"a sampler of {len(payload)} bytes; at most {MAX_SPEC_BYTES}")
    return _SPEC.validate_json(payload)
