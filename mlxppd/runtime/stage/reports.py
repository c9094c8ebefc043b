"""What a stage tells about itself: its status report (``StageReport``, with the agent's
extras) and the trace events it recorded. A part of ``StageWorker`` over the shared
``StageState``.
"""

from __future__ import annotations

import json
import time

import numpy as np

from mlxppd.core.kv_admission import SlotKvManager
from mlxppd.core.protocol.control import (
    LatencyReport,
    SlotReport,
    StageExtras,
    StageReport,
    Status,
    TraceDump,
    TraceReply,
    WireCounters,
    clip,
)
from mlxppd.engine.blas import blas_in_use
from mlxppd.engine.mlx_memory import memory_now
from mlxppd.engine.tp_mirror import MirroredRunner
from mlxppd.runtime.stage.state import StageState, send_reply
from mlxppd.runtime.stage.work import ExtrasSource
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Tensor


class StageReports:
    """Status and TraceDump on a stage."""

    def __init__(self, state: StageState, extras: ExtrasSource | None = None) -> None:
        self._state = state
        # What the agent adds to each status report (config generation, reload error, ...).
        self._extras: ExtrasSource = extras or StageExtras

    async def on_status(
        self, channel: SecureChannel, command: Status, tensor: Tensor | None
    ) -> None:
        await send_reply(channel, self.status(command.rid))

    async def on_trace(
        self, channel: SecureChannel, command: TraceDump, tensor: Tensor | None
    ) -> None:
        # Events can be many: they travel as a JSON byte tensor, not as metadata.
        events = self._state.trace.take()
        if isinstance(self._state.runner, MirroredRunner):  # each rank's track too
            events += await self._state.mlx.run(self._state.runner.follower_events)
        payload = np.frombuffer(json.dumps(events).encode(), dtype=np.uint8)
        await send_reply(channel, TraceReply(rid=command.rid), payload)

    def status(self, rid: int = 0) -> StageReport:
        """This stage's report (the reply to a status command), with the agent's extras."""
        s = self._state
        elapsed = max(time.monotonic() - s.stats.started, 1e-9)
        clock = s.clock.snapshot(time.monotonic())
        h = s.latency
        return StageReport(
            **self._extras().model_dump(),
            rid=rid,
            stage=s.spec.index,
            layers=(s.spec.start, s.spec.end),
            parameter_bytes=s.runner.stage.parameter_bytes if s.runner else 0,
            weights=str(s.runner.stage.weights) if s.runner else "none",
            blas=clip(str(blas_in_use())),
            kv_used_bytes=s.kv.used_bytes,
            kv_budget_bytes=s.kv.budget_bytes,
            active_sequences=len(s.kv.reserved),
            forwards=s.stats.forwards,
            busy_fraction=min(1.0, s.stats.busy_s / elapsed),
            protocol_errors=s.stats.protocol_errors,
            batched_passes=s.stats.batched_passes,
            batched_rows=s.stats.batched_rows,
            busy_s=clock["busy_s"],
            active_s=clock["active_s"],
            wall_s=clock["wall_s"],
            activation_latency=LatencyReport(
                counts=list(h.counts), sum=h.total, count=h.count, max=h.max
            ),
            wire=WireCounters.model_validate(s.transport.stats.snapshot()),
            trace_dropped=s.trace.dropped,
            admission="open" if s.admitting else "draining",
            elastic_state=s.elastic_state.value,
            now=time.time(),
            slots=self._slots(),
            memory=memory_now(),
        )

    def _slots(self) -> list[SlotReport]:
        s = self._state
        kv = s.kv
        if not isinstance(kv, SlotKvManager) or not s.slot_nodes:
            return []
        return [
            SlotReport(
                rank=rank,
                node_id=node,
                parameter_bytes=nbytes,
                kv_used_bytes=slot.used_bytes,
                kv_budget_bytes=slot.budget_bytes,
            )  # fmt: skip
            for rank, ((node, nbytes), slot) in enumerate(
                zip(s.slot_nodes, sorted(kv.slots, key=lambda k: k.rank or 0), strict=True)
            )
        ]
