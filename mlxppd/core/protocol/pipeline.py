"""The metadata of the pipeline's data messages, validated on arrival (frozen pydantic models).

The wire layer bounds and authenticates bytes; these models bound meaning: a message whose
metadata does not parse is a protocol violation, and its connection is closed. Activations go
down the pipeline, sampled tokens (or a micro-batch's failure) back to the coordinator; the
control plane's commands and replies are in ``core/protocol/control.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from pydantic import Field, model_validator

from mlxppd.core.protocol.sampling import MAX_TOP_LOGPROBS
from mlxppd.core.strict import StrictModel

SeqId = Annotated[str, Field(min_length=1, max_length=128)]
#: the most likely tokens of one step and their logprobs, most likely first (top_logprobs)
TopLogprobs = Annotated[
    list[tuple[Annotated[int, Field(ge=0, lt=1 << 32)], float]],
    Field(max_length=MAX_TOP_LOGPROBS),
]


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
    top: TopLogprobs | None = Field(None, description="the most likely tokens and logprobs")


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
    """TOKENS for a decode micro-batch: one sampled token per member, in batch order.

    A member whose request reports top logprobs gets them in its row of ``tops``, so it rides
    in the micro-batch like the others; the lists run in batch order, one row per member. An
    answer whose metadata would not fit one message (many members, each with its top
    logprobs) comes in parts, each a run of rows in batch order: every part but the last says
    ``more`` (``split_answer``).
    """

    group: Annotated[str, Field(min_length=1, max_length=64)]
    seqs: list[SeqId] = Field(min_length=1, max_length=MAX_MICRO_BATCH)
    step: int = Field(ge=0)
    logprobs: list[float | None] | None = Field(
        None, max_length=MAX_MICRO_BATCH, description="each member's token's logprob"
    )
    tops: list[TopLogprobs | None] | None = Field(
        None,
        max_length=MAX_MICRO_BATCH,
        description="each member's most likely tokens and logprobs (None: it asked none; "
        "None for the whole list: no member asked)",
    )
    more: bool = Field(False, description="more rows of this step's answer follow")

    @model_validator(mode="after")
    def _one_row_per_member(self) -> BatchTokenMeta:
        for name, rows in (("logprobs", self.logprobs), ("tops", self.tops)):
            if rows is not None and len(rows) != len(self.seqs):
                raise ValueError(f"{len(rows)} rows of {name} for {len(self.seqs)} members")
        return self


def split_answer(
    meta: BatchTokenMeta, fits: Callable[[BatchTokenMeta], bool]
) -> list[tuple[BatchTokenMeta, slice]]:
    """``meta`` as parts that each ``fits`` one message, with the rows (of its tokens) each
    carries, in batch order; ``[(meta, all rows)]`` when it fits whole. One member's row is
    never cut: its bounds keep it under half the default 4096-byte metadata limit."""
    if len(meta.seqs) == 1 or fits(meta):
        return [(meta, slice(0, len(meta.seqs)))]
    half = len(meta.seqs) // 2
    head = split_answer(_rows(meta, slice(0, half), more=True), fits)
    tail = split_answer(_rows(meta, slice(half, None), more=meta.more), fits)
    return head + [(part, slice(r.start + half, r.stop + half)) for part, r in tail]


def _rows(meta: BatchTokenMeta, rows: slice, more: bool) -> BatchTokenMeta:
    tops = meta.tops[rows] if meta.tops is not None else None
    return BatchTokenMeta(
        group=meta.group,
        seqs=meta.seqs[rows],
        step=meta.step,
        logprobs=meta.logprobs[rows] if meta.logprobs is not None else None,
        tops=tops if tops is not None and any(t is not None for t in tops) else None,
        more=more,
    )


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
