"""What a stage worker's compute loop is given to do, in arrival order, and what it hands its
sender task."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from mlxppd.core.kv_admission import StageKvManager
from mlxppd.core.protocol.pipeline import (
    BatchForwardMeta,
    BatchTokenMeta,
    ForwardMeta,
    GroupFailure,
    SequenceFailure,
    TokenMeta,
)
from mlxppd.core.stages import StageSpec
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.wire.codec import MessageKind, Tensor


@dataclass(frozen=True, slots=True)
class ForwardWork:
    meta: ForwardMeta
    tensor: Tensor | None


@dataclass(frozen=True, slots=True)
class GroupWork:
    meta: BatchForwardMeta
    tensor: Tensor | None


@dataclass(frozen=True, slots=True)
class ReleaseWork:
    seq: str


@dataclass(frozen=True, slots=True)
class ReleaseAllWork:
    """The coordinator is gone: nobody will release its sequences."""


@dataclass(frozen=True, slots=True)
class SwapWork:
    spec: StageSpec
    runner: StageRunner
    kv: StageKvManager
    done: asyncio.Future[None]


Work = ForwardWork | GroupWork | ReleaseWork | ReleaseAllWork | SwapWork
OutMeta = (
    ForwardMeta | BatchForwardMeta | TokenMeta | BatchTokenMeta | GroupFailure | SequenceFailure
)
#: a result for the sender task: kind, metadata, tensor
Output = tuple[MessageKind, OutMeta, Any]
