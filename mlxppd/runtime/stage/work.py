"""A stage worker's parts that its control plane shares: the compute loop's work items (in
arrival order), the sender task's output, the counters, and the hooks the node supplies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mlxppd.core.kv_admission import StageKvManager
from mlxppd.core.protocol.control import LayerLoad, StageExtras
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
    keep: str | None = None
    """keep the caches as this prompt-cache entry"""
    keep_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ForgetWork:
    """Drop prompt-cache entries."""

    entries: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReleaseAllWork:
    """The coordinator is gone: nobody will release its sequences or forget its entries.
    Named, not "everything": a new coordinator's admissions may already be held here."""

    seqs: tuple[str, ...] = ()
    entries: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SwapWork:
    spec: StageSpec
    runner: StageRunner
    kv: StageKvManager
    done: asyncio.Future[None]


Work = ForwardWork | GroupWork | ReleaseWork | ForgetWork | ReleaseAllWork | SwapWork
OutMeta = (
    ForwardMeta | BatchForwardMeta | TokenMeta | BatchTokenMeta | GroupFailure | SequenceFailure
)
#: a result for the sender task: kind, metadata, tensor
Output = tuple[MessageKind, OutMeta, Any]


#: loads a stage's new layers, reusing what the current runner holds: (runner, kv, what it read)
PrepareLayers = Callable[
    [StageSpec, StageRunner | None], Awaitable[tuple[StageRunner, StageKvManager, LayerLoad]]
]
#: what the agent adds to each status report (config generation, reload error, ...)
ExtrasSource = Callable[[], StageExtras]


@dataclass
class StageStats:
    forwards: int = 0
    busy_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    protocol_errors: int = 0
    batched_passes: int = 0
    batched_rows: int = 0
    #: sequences whose forward or sampler failed here (each failed its request alone)
    sequence_failures: int = 0
    #: steps dropped for sequences not held here (released already, or an old pipeline's)
    stale_steps: int = 0
