"""Reading one stage link until it fails: replies go to whoever asked, sampled tokens and a
stage's report that it failed some sequences to the sequence router, heartbeats nowhere (their
arrival was the point). A link that fails, or stays silent past the heartbeat timeout once it
is configured, is handed to the chain's error policy. The coordinator's own heartbeats go out
on every link of the serving chain (``send_heartbeats``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mlxppd.core.protocol.control import Heartbeat, parse_control
from mlxppd.runtime.coordinator.chain import LinkLost, StageChain
from mlxppd.runtime.coordinator.sequence_router import SequenceRouter
from mlxppd.runtime.coordinator.stage_link import StageLink
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import ChannelClosedError, FrameError


class LinkReader:
    """The reader task of every link of a coordinator (``reader(link)`` runs one)."""

    def __init__(self, router: SequenceRouter, on_lost: LinkLost, silence_s: float | None):
        self._router = router
        self._on_lost = on_lost
        #: a configured stage that says nothing (not even a heartbeat) this long is lost
        self._silence_s = silence_s

    async def __call__(self, link: StageLink) -> None:
        try:
            while True:
                # Before its configure a stage sends no heartbeats (a recovery's new links).
                timeout = self._silence_s if link.configured else None
                try:
                    async with asyncio.timeout(timeout):
                        message = await link.channel.recv()
                except TimeoutError:
                    self._on_lost(link, f"stage {link.node.id} sent nothing for {timeout:g} s")
                    return
                if message.kind is MessageKind.REPLY:
                    link.control.deliver(message)
                elif message.kind is MessageKind.CONTROL:
                    parse_control(message.meta)  # a heartbeat: receiving it was the point
                else:
                    self._router.deliver(link.node.id, message)
        except ChannelClosedError as exc:
            closed = "closed its connection" if exc.clean else f"was lost: {exc}"
            self._on_lost(link, f"stage {link.node.id} {closed}")
        except FrameError as exc:
            self._on_lost(link, f"lost stage {link.node.id}: {exc}")
        except Exception as exc:
            self._on_lost(link, f"bad message from stage {link.node.id}: {exc}")


async def send_heartbeats(chain: Callable[[], StageChain], interval_s: float) -> None:
    """Tell every stage of ``chain()`` (the serving one: a recovery replaces it) that the
    coordinator is alive, every ``interval_s``; a link that fails here is lost."""
    beat = Heartbeat().model_dump()
    while True:
        serving = chain()
        for link in list(serving.links):
            if link.alive:
                try:
                    await link.channel.send(MessageKind.CONTROL, beat)
                except ChannelClosedError as exc:
                    serving.lost(link, f"stage {link.node.id} was lost: {exc}")
        await asyncio.sleep(interval_s)
