"""One request/reply helper for the control planes: a typed command out, a typed reply back.

Every command carries a request id (``rid``) that its reply echoes. A ``ControlClient`` numbers
the commands it sends on one channel, waits (with a timeout) for the reply with that id, and
parses it into the model the caller names, so a reply is never a dict read by key: one of the
wrong shape raises ``BadReplyError``. A channel that carries other messages too (the
coordinator's stage links, which bring the sampled tokens back) hands each REPLY to
``deliver`` from its own reader; a channel that carries nothing else runs ``read_replies``.
The pipeline (``core/protocol/control.py``) and zero-config bring-up
(``core/protocol/assignment.py``) both talk through it.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, TypeVar

from pydantic import ValidationError

from mlxppd.core.errors import PermanentError
from mlxppd.core.strict import StrictModel
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Message, MessageKind
from mlxppd.wire.errors import ChannelClosedError, FrameError

__all__ = ["BadReplyError", "ControlClient"]

ReplyT = TypeVar("ReplyT", bound=StrictModel)
_MAX_RID = (1 << 63) - 1


class BadReplyError(PermanentError):
    """A peer answered with a reply that does not parse as the expected model."""


class ControlClient:
    """Typed requests on one channel; ``timeout_s`` bounds each wait for a reply."""

    def __init__(self, channel: SecureChannel, timeout_s: float) -> None:
        self.channel = channel
        self.timeout_s = timeout_s
        self._rids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Message]] = {}

    async def ask(
        self,
        command: StrictModel,
        reply: type[ReplyT],
        *,
        timeout_s: float | None = None,
        payload: Any = None,
    ) -> ReplyT:
        """Send ``command`` and return its reply as a ``reply``.

        Raises ``TimeoutError`` when none came in time, ``ChannelClosedError`` (or whatever
        ``fail`` was given) when the channel went away, ``BadReplyError`` for a malformed one.
        """
        answer = await self._exchange(command, timeout_s, payload)
        return self._parse(answer, reply)

    async def ask_with_payload(
        self,
        command: StrictModel,
        reply: type[ReplyT],
        *,
        timeout_s: float | None = None,
        payload: Any = None,
    ) -> tuple[ReplyT, bytes]:
        """``ask``, plus the reply's tensor bytes (empty when it has none)."""
        answer = await self._exchange(command, timeout_s, payload)
        payload = bytes(answer.tensor.data) if answer.tensor is not None else b""
        return self._parse(answer, reply), payload

    async def tell(self, command: StrictModel, payload: Any = None) -> None:
        """Send a command that has no reply (release; a prepare's data, ``payload``)."""
        await self.channel.send(MessageKind.CONTROL, command.model_dump(mode="json"), payload)

    def deliver(self, message: Message) -> bool:
        """Hand a received REPLY to the request waiting for it; False when none waits."""
        if message.kind is not MessageKind.REPLY:
            return False
        rid = message.meta.get("rid")
        future = self._waiting.get(rid) if type(rid) is int else None
        if future is None or future.done():
            return False
        future.set_result(message)
        return True

    def fail(self, exc: BaseException) -> None:
        """Fail every request still waiting (the channel or the pipeline is gone)."""
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(exc)

    async def read_replies(self) -> None:
        """The reader of a channel that carries nothing but replies: until it closes."""
        try:
            async for message in self.channel:
                self.deliver(message)
            self.fail(ChannelClosedError("the peer closed the channel", clean=True))
        except (ChannelClosedError, FrameError) as exc:
            self.fail(exc)

    async def _exchange(
        self, command: StrictModel, timeout_s: float | None, payload: Any = None
    ) -> Message:
        rid = next(self._rids) & _MAX_RID
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        try:
            meta = command.model_copy(update={"rid": rid}).model_dump(mode="json")
            await self.channel.send(MessageKind.CONTROL, meta, payload)
            async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
                return await future
        finally:
            self._waiting.pop(rid, None)

    def _parse(self, answer: Message, reply: type[ReplyT]) -> ReplyT:
        try:
            return reply.model_validate(dict(answer.meta))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"]) or "reply"
            raise BadReplyError(
                f"{self.channel.peer_address} answered with a malformed {reply.__name__} "
                f"({where}: {error['msg']}); does it run the same mlxpp version?"
            ) from None
