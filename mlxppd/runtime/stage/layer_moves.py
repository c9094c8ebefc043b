"""A stage's side of an elastic repartition (docs/elastic.md): admission closed for the drain
with the elastic state to report meanwhile, then the two phases of a layer move, also used by
a standby adopting a lost stage and by survivors closing a gap: ``prepare`` loads the new layers
beside the old, ``commit`` swaps them in, ``abort`` drops them. A part of ``StageWorker`` over
the shared ``StageState``; the layers loaded and not yet swapped in are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from mlxppd.core.agent.elastic import ElasticState
from mlxppd.core.kv_admission import StageKvManager
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.log_text import quoted
from mlxppd.core.protocol.control import Ack, Admission, LayerLoad, Reassign, ReassignReply, clip
from mlxppd.core.stages import StageSpec
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.runtime.stage.state import ProtocolViolation, StageState, send_reply
from mlxppd.runtime.stage.work import PrepareLayers, SwapWork
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Tensor
from mlxppd.wire.errors import ChannelClosedError


class LayerMoves:
    """Admission and Reassign on a stage, and swapping its layers."""

    def __init__(self, state: StageState, prepare_layers: PrepareLayers | None = None) -> None:
        self._state = state
        # None: this stage's layers are fixed (a tensor-parallel stage, a node without files).
        self._prepare_layers = prepare_layers
        self._staged: tuple[StageSpec, StageRunner, StageKvManager] | None = None

    @property
    def moving(self) -> bool:
        """New layers are loaded beside the served ones, not yet swapped in."""
        return self._staged is not None

    async def swap(self, spec: StageSpec, runner: StageRunner, kv: StageKvManager) -> None:
        """Serve new layers from now on. Queued after any earlier work, so nothing in flight
        runs half on the old layers and half on the new."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._state.work.put(SwapWork(spec, runner, kv, done))
        await done

    async def on_admission(
        self, channel: SecureChannel, command: Admission, tensor: Tensor | None
    ) -> None:
        # The wire carries the state's value; a value no machine has is malformed, as a bad
        # field would be (refused and counted by the read loop).
        try:
            elastic = ElasticState(command.state)
        except ValueError:
            raise ProtocolViolation(f"no elastic state {quoted(command.state)}") from None
        self._state.admitting = command.open
        self._state.elastic_state = elastic
        await send_reply(channel, Ack(rid=command.rid))

    async def on_reassign(
        self, channel: SecureChannel, command: Reassign, tensor: Tensor | None
    ) -> None:
        # Loading takes long; this channel keeps answering status meanwhile.
        self._state.side_tasks.spawn(self._reassign(channel, command), name="stage-reassign")

    async def _reassign(self, channel: SecureChannel, command: Reassign) -> None:
        reply = ReassignReply(rid=command.rid)
        try:
            if command.phase == "prepare":
                load = await self._prepare(command.plan, command.stage)
                reply = ReassignReply(rid=command.rid, **load.model_dump())
            elif command.phase == "commit":
                if self._staged is None:
                    raise ProtocolViolation("commit without a prepared plan")
                spec, runner, kv = self._staged
                self._staged = None
                # The KV budget belongs to the node, not to its layers: the one in force now
                # (a reload may have changed it since this stage started) carries over.
                kv.budget_bytes = self._state.kv.budget_bytes
                await self.swap(spec, runner, kv)
                self._state.elastic_state = ElasticState.IDLE
            else:
                self._staged = None
                self._state.elastic_state = ElasticState.IDLE
        except Exception as exc:  # reported to the coordinator, which aborts everywhere
            self._staged = None
            error = clip(str(exc) or type(exc).__name__)
            reply = ReassignReply(rid=command.rid, ok=False, error=error)
        with contextlib.suppress(ChannelClosedError):
            await send_reply(channel, reply)

    async def _prepare(self, plan: Sequence[LayerRange], stage: int | None) -> LayerLoad:
        """Load the layers of stage ``stage`` of ``plan`` (None: this one's index) beside the
        current ones: a repartition, a standby adopting a lost stage, survivors closing a gap."""
        s = self._state
        if self._prepare_layers is None:
            raise ProtocolViolation("this stage cannot change its layers")
        index = s.spec.index if stage is None else stage
        if not 0 <= index < len(plan):
            raise ProtocolViolation(f"no stage {index} in a plan of {len(plan)} stages")
        if s.kv.reserved:
            raise ProtocolViolation(f"{len(s.kv.reserved)} sequences still hold KV here")
        start, end = plan[index].pair
        spec = StageSpec(index, len(plan), start, end)
        s.elastic_state = ElasticState.RESUMING
        runner, kv, load = await self._prepare_layers(spec, s.runner)
        self._staged = (spec, runner, kv)
        return load
