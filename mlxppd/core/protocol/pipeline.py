"""The metadata of the pipeline's data messages, validated on arrival (frozen pydantic models).

The wire layer bounds and authenticates bytes; these models bound meaning: a message whose
metadata does not parse is a protocol violation, and its connection is closed. Activations go
down the pipeline, sampled tokens (or a micro-batch's failure) back to the coordinator; the
control plane's commands and replies are in ``core/protocol/control.py``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from mlxppd.core.protocol.sampling import MAX_TOP_LOGPROBS
from mlxppd.core.strict import StrictModel

SeqId = Annotated[str, Field(min_length=1, max_length=128)]


class ForwardMeta(StrictModel):
    """ACTIVATION: run the stage's layers on this input for one sequence."""

    seq: SeqId
    cached: tuple[SeqId, Annotated[int, Field(ge=1, le=1 << 24)]] | None = Field(
        None,
        description="start from a copy of this prompt-cache entry's caches, cut to its first "
        "N tokens (the sequence's first input only)",
    )
    forks: list[SeqId] | None = Field(
        None,
        max_length=64,
        description="after running this input, copy the sequence's KV caches for each of these "
        "(the n choices of one prompt share its prefill)",
    )
    step: int = Field(ge=0, description="request-local step number (0 = first prefill chunk)")
    sample: bool = Field(description="last stage: sample a token from the last position")
    logprobs: bool = Field(False, description="last stage: also return the token's logprob")
    sent_at: float | None = Field(None, description="sender's wall clock at send, seconds")


class TokenMeta(StrictModel):
    """TOKENS: the token the last stage sampled for a sequence."""

    seq: SeqId
    step: int = Field(ge=0)
    logprob: float | None = None
    top: list[tuple[Annotated[int, Field(ge=0, lt=1 << 32)], float]] | None = Field(
        None, max_length=MAX_TOP_LOGPROBS, description="the most likely tokens and logprobs"
    )


MAX_MICRO_BATCH = 256


class BatchForwardMeta(StrictModel):
    """ACTIVATION for a decode micro-batch: one token per sequence, one batched forward pass.

    The group keeps its batched KV caches between steps on every stage. ``seqs`` lists the
    members in batch order: the previous members still present (in their previous order), then
    the ones joining, whose prefilled caches are merged in; absent members leave the batch.
    """

    group: Annotated[str, Field(min_length=1, max_length=64)]
    seqs: list[SeqId] = Field(min_length=1, max_length=MAX_MICRO_BATCH)
    step: int = Field(ge=0, description="group-local step number")
    sample: bool = True
    logprobs: bool = False
    solo: bool = Field(
        False, description="nothing else is in the pipeline: a stage may use all its cores"
    )
    sent_at: float | None = Field(None, description="sender's wall clock at send, seconds")


class BatchTokenMeta(StrictModel):
    """TOKENS for a decode micro-batch: one sampled token per member, in batch order."""

    group: Annotated[str, Field(min_length=1, max_length=64)]
    seqs: list[SeqId] = Field(min_length=1, max_length=MAX_MICRO_BATCH)
    step: int = Field(ge=0)
    logprobs: list[float | None] | None = None


class GroupFailure(StrictModel):
    """ERROR: a decode micro-batch could not run on a stage; its requests fail cleanly."""

    group: Annotated[str, Field(min_length=1, max_length=64)]
    seqs: list[SeqId] = Field(min_length=1, max_length=MAX_MICRO_BATCH)
    message: str = Field(max_length=1000)


class SequenceFailure(StrictModel):
    """ERROR: one sequence's forward or sampling failed on a stage; that request alone fails."""

    seq: SeqId
    stage: int = Field(ge=0, le=4096)
    message: str = Field(max_length=1000)


def regroup(previous: list[str], requested: list[str]) -> list[str]:
    """The batch order a stage expects: surviving members in order, then the newcomers."""
    wanted = set(requested)
    kept = [s for s in previous if s in wanted]
    return kept + [s for s in requested if s not in set(previous)]
