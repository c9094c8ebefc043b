"""The links to every stage of one pipeline, in stage order, and the layer ranges they hold.

The serving pipeline is a ``StageChain``; a recovery builds one on its trial links and uses it
as is. Every request to a stage goes through ``ask``, with one error policy: a stage that does
not answer (closed, silent past the timeout, or nonsense) is handed to ``on_lost``, which marks
the link failed and says what the caller raises (``Coordinator.link_lost``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from mlxppd.core.config.cluster import Node
from mlxppd.core.errors import TemporaryError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.protocol.control import (
    Ack,
    Admission,
    Configure,
    Reassign,
    ReassignReply,
    StageReport,
    Status,
)
from mlxppd.core.strict import StrictModel
from mlxppd.runtime.backends.contract import BackendUnavailable
from mlxppd.runtime.coordinator.control_client import BadReplyError
from mlxppd.runtime.coordinator.stage_link import StageLink
from mlxppd.wire.errors import ChannelClosedError, FrameError
from mlxppd.wire.tasks import stop_tasks

ReplyT = TypeVar("ReplyT", bound=StrictModel)
log = logging.getLogger("mlxppd.coordinator")

REPLY_TIMEOUT_S = 30.0
#: what a lost link becomes: marks it failed, returns the exception its caller raises
LinkLost = Callable[[StageLink, str], Exception]
Phase = Literal["prepare", "commit", "abort"]
#: how a stage fails to answer: its link closed, it stayed silent, or it answered nonsense
NO_ANSWER = (ChannelClosedError, TimeoutError, BadReplyError)


class LayerMoveError(TemporaryError):
    """Moving the stages to new layer ranges failed; ``refusals`` is (stage, error) per stage
    that refused. After a refused prepare every stage keeps its old range; after a failed
    commit (``committed``) a stage is broken, not busy."""

    def __init__(self, message: str, refusals: list[tuple[int, str]], *, committed: bool):
        super().__init__(message)
        self.refusals = refusals
        self.committed = committed


class StageChain:
    """One pipeline's stage links and plan, and what is done to every stage of it at once."""

    def __init__(
        self, links: list[StageLink], plan: tuple[LayerRange, ...] | None, on_lost: LinkLost
    ) -> None:
        self.links = links
        #: the layer ranges the stages hold (None: the stages' own, never checked)
        self.plan = plan
        self._on_lost = on_lost

    # -- the one request path ------------------------------------------------------------------

    async def ask(
        self, link: StageLink, command: StrictModel, reply: type[ReplyT],
        timeout_s: float = REPLY_TIMEOUT_S, payload: Any = None,
    ) -> ReplyT:  # fmt: skip
        """One request on ``link``; a stage that does not answer is lost (``on_lost``)."""
        try:
            return await link.control.ask(command, reply, timeout_s=timeout_s, payload=payload)
        except NO_ANSWER as exc:
            raise self._silent(link, exc) from None

    async def ask_with_payload(
        self, link: StageLink, command: StrictModel, reply: type[ReplyT],
        timeout_s: float = REPLY_TIMEOUT_S,
    ) -> tuple[ReplyT, bytes]:  # fmt: skip
        """``ask``, plus the reply's tensor bytes (a trace dump)."""
        try:
            return await link.control.ask_with_payload(command, reply, timeout_s=timeout_s)
        except NO_ANSWER as exc:
            raise self._silent(link, exc) from None

    def _silent(self, link: StageLink, exc: Exception) -> Exception:
        return self._on_lost(link, f"stage {link.node.id} did not answer: {exc or 'timeout'}")

    def lost(self, link: StageLink, reason: str) -> Exception:
        """``link`` failed under a send: mark it, and what the sender raises."""
        return self._on_lost(link, reason)

    async def ask_each(
        self, command: StrictModel | Sequence[StrictModel], reply: type[ReplyT],
        timeout_s: float = REPLY_TIMEOUT_S, payloads: Sequence[Any] | None = None,
    ) -> list[ReplyT]:  # fmt: skip
        """``command`` (or one per stage) to every stage at once; the replies in stage order."""
        commands = command if isinstance(command, Sequence) else [command] * len(self.links)
        sent = payloads if payloads is not None else [None] * len(self.links)
        return list(
            await asyncio.gather(
                *(
                    self.ask(link, one, reply, timeout_s, payload)
                    for link, one, payload in zip(self.links, commands, sent, strict=True)
                )
            )
        )

    async def tell_each(self, command: StrictModel) -> None:
        """``command`` to every live stage, no reply; a link that fails here is its reader's to
        report (a stage that went away frees what the command would have)."""
        for link in self.links:
            if link.alive:
                with contextlib.suppress(ChannelClosedError, FrameError):
                    await link.control.tell(command)

    # -- what is asked of every stage ----------------------------------------------------------

    def nodes(self) -> list[Node]:
        return [link.node for link in self.links]

    def alive(self, node_id: str) -> bool:
        return any(link.alive for link in self.links if link.node.id == node_id)

    async def status(self) -> list[StageReport]:
        """Each stage's own report (KV use, busy fraction, forwards, the layers it holds)."""
        return await self.ask_each(Status(), StageReport)

    async def reports(self) -> dict[str, StageReport | None]:
        """Each stage's report by node id; None for a stage that is down or did not answer."""

        async def one(link: StageLink) -> StageReport | None:
            if not link.alive:
                return None
            with contextlib.suppress(BackendUnavailable):
                return await self.ask(link, Status(), StageReport)
            return None

        replies = await asyncio.gather(*(one(link) for link in self.links))
        return {link.node.id: reply for link, reply in zip(self.links, replies, strict=True)}

    async def set_admission(self, open_: bool, state: str) -> None:
        """Open or close admission on every stage (an elastic drain), reporting ``state``."""
        await self.ask_each(Admission(open=open_, state=state), Ack)

    async def configure(
        self, trace: bool, heartbeat_interval_s: float | None, heartbeat_timeout_s: float | None
    ) -> None:
        """Tell each stage where its output goes (and how often to say it is alive)."""
        for i, link in enumerate(self.links):
            nxt = self.links[i + 1].node if i + 1 < len(self.links) else None
            configure = Configure(
                next_host=nxt.host if nxt else None,
                next_port=nxt.port if nxt else None,
                next_node=nxt.id if nxt else None,
                trace=trace,
                heartbeat_interval_s=heartbeat_interval_s,
                heartbeat_timeout_s=heartbeat_timeout_s,
            )
            reply = await self.ask(link, configure, Ack)
            link.configured = True
            if not reply.ok:
                raise TemporaryError(
                    f"stage {link.node.id} could not reach {nxt.id if nxt else '?'}: {reply.error}"
                )

    async def close(self) -> None:
        """Close every link: each stage frees the KV of every sequence sent on it."""
        await drop_links(self.links)

    # -- the two-phase move to new layer ranges ------------------------------------------------

    async def move(
        self, target: tuple[LayerRange, ...], prepare_timeout_s: float,
        stages: list[int] | None = None,
    ) -> list[ReassignReply]:  # fmt: skip
        """The two-phase move to ``target``, the one place it is written: every stage prepares
        its new range beside the old one (loading only the layers it gains), then, only when
        all are ready, every stage commits; one refusal aborts everywhere. ``stages``: the
        stage each link becomes (a standby adopting a lost stage; None: the one it is).
        Returns the prepare replies (what each stage loaded); the plan becomes ``target``."""
        prepared = await self._phase("prepare", target, stages, prepare_timeout_s)
        refused = [(i, str(r.error)) for i, r in enumerate(prepared) if not r.ok]
        if refused:
            with contextlib.suppress(BackendUnavailable):
                await self._phase("abort", target, stages, 30.0)
            errors = "; ".join(error for _, error in refused)
            raise LayerMoveError(
                f"stages could not load the planned layers: {errors}", refused, committed=False
            )
        committed = await self._phase("commit", target, stages, 60.0)
        failed = [(i, str(r.error)) for i, r in enumerate(committed) if not r.ok]
        if failed:
            # A commit is a pointer swap; failing here means a stage is broken, not busy.
            raise LayerMoveError(
                f"a stage failed to switch layers: {failed}", failed, committed=True
            )
        self.plan = target
        return prepared

    async def _phase(
        self, phase: Phase, target: tuple[LayerRange, ...], stages: list[int] | None,
        timeout_s: float,
    ) -> list[ReassignReply]:  # fmt: skip
        each = stages if stages is not None else [None] * len(self.links)
        commands = [Reassign(phase=phase, plan=target, stage=s) for s in each]
        return await self.ask_each(commands, ReassignReply, timeout_s)


async def drop_links(links: list[StageLink]) -> None:
    """Close ``links``: each stage frees the KV of every sequence sent on it. A request still
    waiting on one gets its link's closing at once (the error policy says what it raises),
    not its reply timeout: its reader, which would have told it, is stopped here."""
    for link in links:  # all marked first: a closing one yields, and the rest are gone too
        link.alive = False
        link.control.fail(ChannelClosedError("the coordinator dropped this stage link", clean=True))
    for link in links:
        if link.reader is not None:
            link.reader.cancel()
        await link.channel.close()
    await stop_tasks(*(link.reader for link in links), cancel=False, ignore_errors=True)
