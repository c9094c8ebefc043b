"""The metadata of the pipeline's messages, validated on arrival (frozen pydantic models).

The wire layer bounds and authenticates bytes; these models bound meaning: a message whose
metadata does not parse is a protocol violation, and its connection is closed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from mlxppd.core.strict import StrictModel

SeqId = Annotated[str, Field(min_length=1, max_length=128)]


class ForwardMeta(StrictModel):
    """ACTIVATION: run the stage's layers on this input for one sequence."""

    seq: SeqId
    step: int = Field(ge=0, description="request-local step number (0 = first prefill chunk)")
    sample: bool = Field(description="last stage: sample a token from the last position")
    logprobs: bool = Field(False, description="last stage: also return the token's logprob")
    sent_at: float | None = Field(None, description="sender's wall clock at send, seconds")


class TokenMeta(StrictModel):
    """TOKENS: the token the last stage sampled for a sequence."""

    seq: SeqId
    step: int = Field(ge=0)
    logprob: float | None = None


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
    sent_at: float | None = Field(None, description="sender's wall clock at send, seconds")


class BatchTokenMeta(StrictModel):
    """TOKENS for a decode micro-batch: one sampled token per member, in batch order."""

    group: Annotated[str, Field(min_length=1, max_length=64)]
    seqs: list[SeqId] = Field(min_length=1, max_length=MAX_MICRO_BATCH)
    step: int = Field(ge=0)
    logprobs: list[float | None] | None = None


def regroup(previous: list[str], requested: list[str]) -> list[str]:
    """The batch order a stage expects: surviving members in order, then the newcomers."""
    wanted = set(requested)
    kept = [s for s in previous if s in wanted]
    return kept + [s for s in requested if s not in set(previous)]


class Admit(StrictModel):
    op: Literal["admit"] = "admit"
    rid: int = Field(ge=0, description="request id echoed in the reply")
    seq: SeqId
    prompt_tokens: int = Field(ge=1, le=1 << 24)
    max_tokens: int = Field(ge=1, le=1 << 24)
    commit: bool = Field(description="false: dry run only; true: reserve the KV bytes")
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    plan: list[tuple[int, int]] | None = Field(
        None,
        max_length=4096,
        description="[start, end) layers of every stage as the coordinator expects them; a "
        "stage holding other layers refuses (plan_mismatch)",
    )


class Release(StrictModel):
    op: Literal["release"] = "release"
    seq: SeqId


class Configure(StrictModel):
    """Tell a stage where its output goes (None on the last stage: back to the sender)."""

    op: Literal["configure"] = "configure"
    rid: int = Field(ge=0)
    next_host: str | None = Field(None, max_length=255)
    next_port: int | None = Field(None, ge=1, le=65535)
    next_node: str | None = Field(None, max_length=128)
    trace: bool = Field(False, description="record trace events until asked for them")


class TraceDump(StrictModel):
    """Send the recorded trace events (and forget them)."""

    op: Literal["trace"] = "trace"
    rid: int = Field(ge=0)


class Status(StrictModel):
    op: Literal["status"] = "status"
    rid: int = Field(ge=0)


class Admission(StrictModel):
    """Open or close a stage's admission (an elastic drain closes every stage)."""

    op: Literal["admission"] = "admission"
    rid: int = Field(ge=0)
    open: bool
    state: str = Field("idle", max_length=32, description="elastic state to report meanwhile")


class Reassign(StrictModel):
    """Elastic resume, in two phases so that a failure anywhere changes nothing anywhere:
    ``prepare`` loads the stage's new layers beside the old, ``commit`` switches to them,
    ``abort`` drops what ``prepare`` loaded."""

    op: Literal["reassign"] = "reassign"
    rid: int = Field(ge=0)
    phase: Literal["prepare", "commit", "abort"]
    plan: list[tuple[int, int]] = Field(
        min_length=1, max_length=4096, description="[start, end) layers of every stage"
    )


Command = Admit | Release | Configure | Status | TraceDump | Admission | Reassign
Control = Annotated[Command, Field(discriminator="op")]
_CONTROL: TypeAdapter[Command] = TypeAdapter(Control)


def parse_control(meta: Any) -> Command:
    """A CONTROL message's metadata as its typed command (pydantic ValidationError if bad)."""
    return _CONTROL.validate_python(dict(meta))
