"""A stage's side of the coordinator's link: ``Configure`` (which coordinator this is, where
output goes, how often to say "alive" and how long its silence may last) and ``Heartbeat``.

A part of ``StageWorker`` over the shared ``StageState``: the coordinator's channel, the one
downstream and the heartbeat timeout it sets there are what the read loop and the sender use.
"""

from __future__ import annotations

import asyncio

from mlxppd.core.protocol.control import Ack, Configure, Heartbeat, clip
from mlxppd.runtime.stage.state import StageState, send_reply
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind, Tensor
from mlxppd.wire.errors import ChannelClosedError


class CoordinatorLink:
    """Configure and Heartbeat on a stage."""

    def __init__(self, state: StageState) -> None:
        self._state = state

    async def on_configure(
        self, channel: SecureChannel, command: Configure, tensor: Tensor | None
    ) -> None:
        await send_reply(channel, await self._configure(channel, command))

    async def _configure(self, channel: SecureChannel, command: Configure) -> Ack:
        s = self._state
        first = s.coordinator is not channel
        if first and s.coordinator is not None:
            # Another coordinator (or this one, reconnected after a failover) takes over:
            # nobody will release what the previous one admitted here.
            await s.work.put(s.release_accounting())
        s.coordinator = channel
        s.trace.enabled = command.trace
        s.heartbeat_timeout_s = command.heartbeat_timeout_s
        if first and command.heartbeat_interval_s is not None:
            s.side_tasks.spawn(
                self._heartbeats(channel, command.heartbeat_interval_s), name="stage-heartbeat"
            )
        if command.next_host is None or command.next_port is None:
            s.downstream = channel
            return Ack(rid=command.rid)
        try:
            if s.downstream is not None:
                await s.downstream.close()
            s.downstream = await s.transport.connect(
                command.next_host, command.next_port, expected_peer=command.next_node
            )
        except Exception as exc:  # reported to the coordinator, which gives up cleanly
            return Ack(rid=command.rid, ok=False, error=clip(str(exc)))
        return Ack(rid=command.rid)

    async def on_heartbeat(
        self, channel: SecureChannel, command: Heartbeat, tensor: Tensor | None
    ) -> None:
        pass  # receiving it was the point: the read loop's deadline starts again

    async def _heartbeats(self, channel: SecureChannel, interval_s: float) -> None:
        """Say "alive" to the coordinator every interval while it is the coordinator."""
        while self._state.coordinator is channel and not channel.closed:
            try:
                await channel.send(MessageKind.CONTROL, Heartbeat().model_dump())
            except ChannelClosedError:
                return
            await asyncio.sleep(interval_s)
