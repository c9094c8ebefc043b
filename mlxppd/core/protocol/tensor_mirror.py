"""What rank 0 of a tensor-parallel stage tells its other ranks: each call it is about to make
that runs the layers or touches the caches (``engine/tp_mirror.py`` makes it on their shard).
It travels on the authenticated, encrypted transport from rank 0 to each other rank, one
CONTROL message per call, with the call's input tensor when it has one."""

from __future__ import annotations

import enum
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from mlxppd.core.protocol.pipeline import MAX_MICRO_BATCH, SeqId
from mlxppd.core.strict import StrictModel

__all__ = ["MirrorCall", "MirrorOp", "parse_mirror_call"]

Name = Annotated[str, Field(min_length=1, max_length=128)]


class MirrorOp(enum.IntEnum):
    FORWARD = 1
    FORWARD_GROUP = 2
    FORK = 3
    KEEP = 4
    START_FROM = 5
    FORGET = 6
    RELEASE_ALL = 7
    RELEASE = 8
    TRACE = 9
    """every rank hands rank 0 the trace events it recorded (gathered over the ring)"""


class MirrorCall(StrictModel):
    """One call, with the arguments that call takes (the others unset)."""

    mirror: MirrorOp
    seq: SeqId | None = None
    group: Name | None = None
    seqs: list[SeqId] | None = Field(None, min_length=1, max_length=MAX_MICRO_BATCH)
    source: SeqId | None = None
    entry: Name | None = None
    tokens: int | None = Field(None, ge=0, le=1 << 31)


_CALL: TypeAdapter[MirrorCall] = TypeAdapter(MirrorCall)


def parse_mirror_call(meta: Any) -> MirrorCall:
    """A mirror message's metadata as its call (pydantic ValidationError if bad)."""
    return _CALL.validate_python(dict(meta))
