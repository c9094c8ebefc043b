"""What every part of a stage worker shares: one state object, and how a command is answered
or refused.

``StageWorker`` (``worker.py``) builds one ``StageState`` and hands it to each of its parts (the
data plane in ``compute.py``, the command handlers by concern); no part derives from it. A field
lives here when more than one part, or a part and the worker, reads or writes it; what only one
part uses is that part's own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mlxppd.core.agent.elastic import ElasticState
from mlxppd.core.kv_admission import StageKvManager
from mlxppd.core.stage_accounting import ActivityClock, LatencyHistogram
from mlxppd.core.stages import StageSpec
from mlxppd.core.strict import StrictModel
from mlxppd.engine.mlx_memory import CacheKeeper
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.runtime.observability.trace import TraceBuffer
from mlxppd.runtime.stage.work import ReleaseAllWork, StageStats
from mlxppd.runtime.stage.work_queue import WorkQueue
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.tasks import TaskSet
from mlxppd.wire.transport import Transport


class ProtocolViolation(Exception):
    """A message that authenticated fine but makes no sense here."""


async def send_reply(channel: SecureChannel, answer: StrictModel, payload: Any = None) -> None:
    """A REPLY whose metadata is exactly ``answer``'s fields."""
    await channel.send(MessageKind.REPLY, answer.model_dump(mode="json"), payload)


class StageState:
    """A stage worker's shared fields, and the two helpers every part of it uses."""

    def __init__(
        self,
        spec: StageSpec,
        runner: StageRunner | None,
        kv: StageKvManager,
        transport: Transport,
        mlx: MlxThread,
    ) -> None:
        # The layers served now: replaced together, on the compute loop (a swap).
        self.spec = spec
        self.runner = runner
        self.kv = kv
        self.transport = transport
        self.mlx = mlx
        self.stats = StageStats()
        self.clock = ActivityClock(started=time.monotonic())
        self.latency = LatencyHistogram()
        self.trace = TraceBuffer(pid=f"stage-{spec.index}", enabled=False)
        # Arrival order, but a decode step runs before the next prefill chunk (work_queue.py).
        self.work = WorkQueue()
        # mlx's buffer cache: capped, and given back whenever the stage goes idle.
        self.cache = CacheKeeper()
        #: where activations go (the next stage, or the coordinator's channel on the last)
        self.downstream: SecureChannel | None = None
        #: the channel of the coordinator that configured this stage (None: none now)
        self.coordinator: SecureChannel | None = None
        # Set by the coordinator's Configure: how long its silence may last before it counts
        # as lost (None: no heartbeats); the read loop waits that long for its next message.
        self.heartbeat_timeout_s: float | None = None
        # Closed while draining (reload, shutdown): admits are refused, running sequences finish.
        self.admitting = True
        # What the coordinator's Admission said (a drain) or a layer move set; in StageReport.
        self.elastic_state = ElasticState.IDLE
        # Long commands (a layer load, an adapter read, heartbeats) run beside the read loop.
        self.side_tasks = TaskSet()
        # A tensor-parallel stage's slots: every rank's node id and shard bytes, rank order.
        self.slot_nodes: tuple[tuple[str, int], ...] = ()
        #: set when a tensor-parallel rank of this stage is gone: the stage cannot compute
        #: again until its ranks start again together (the node's owner restarts it)
        self.ring_lost = asyncio.Event()

    def release_accounting(self) -> ReleaseAllWork:
        """Free every sequence's KV budget at once (the coordinator that held them is gone);
        the work that frees their caches, in order on the compute loop."""
        held = ReleaseAllWork(tuple(self.kv.reserved), tuple(self.kv.pinned))
        self.kv.clear()  # the prompt-cache entries were the coordinator's too
        self.clock.set_active(0, time.monotonic())
        return held

    def layers(self) -> StageRunner:
        """The runner serving now; a standby's refusal when there is none."""
        if self.runner is None:
            raise ProtocolViolation("this node is a standby: it serves no layers yet")
        return self.runner
