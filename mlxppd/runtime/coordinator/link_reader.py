"""What comes back from the stages on the coordinator's links: replies, sampled tokens (one
sequence's, or a micro-batch's), a stage's report that it failed some sequences, heartbeats.
A mixin of ``Coordinator`` (``coordinator.py``), which owns the links and the queues."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np

from mlxppd.core.protocol.control import parse_control
from mlxppd.core.protocol.pipeline import BatchTokenMeta, GroupFailure, SequenceFailure, TokenMeta
from mlxppd.runtime.backends.contract import SequenceFailed, TokenEvent
from mlxppd.runtime.coordinator.micro_batcher import MicroBatcher
from mlxppd.runtime.coordinator.stage_link import StageLink
from mlxppd.wire.codec import Message, MessageKind
from mlxppd.wire.errors import ChannelClosedError, FrameError


class LinkReader:
    """Reads every stage link (mixed into ``Coordinator``)."""

    failover: Any
    _queues: dict[str, asyncio.Queue[TokenEvent | Exception]]
    _batcher: MicroBatcher | None

    if TYPE_CHECKING:  # provided by Coordinator: how a link's failure is handled

        def _fail(self, link: StageLink, reason: str) -> None: ...

    async def _read(self, link: StageLink) -> None:
        # A stage in the chain that says nothing (not even a heartbeat) for the timeout is a
        # lost one; before its configure it sends no heartbeats (a recovery's new links).
        beats = self.failover.heartbeat_timeout_s if self.failover is not None else None
        try:
            while True:
                timeout = beats if link.configured else None
                try:
                    async with asyncio.timeout(timeout):
                        message = await link.channel.recv()
                except TimeoutError:
                    self._fail(link, f"stage {link.node.id} sent nothing for {timeout:g} s")
                    return
                self._dispatch(link, message)
        except ChannelClosedError as exc:
            closed = "closed its connection" if exc.clean else f"was lost: {exc}"
            self._fail(link, f"stage {link.node.id} {closed}")
        except FrameError as exc:
            self._fail(link, f"lost stage {link.node.id}: {exc}")
        except Exception as exc:
            self._fail(link, f"bad message from stage {link.node.id}: {exc}")

    def _dispatch(self, link: StageLink, message: Message) -> None:
        if message.kind is MessageKind.REPLY:
            link.control.deliver(message)
        elif (
            message.kind is MessageKind.TOKENS
            and message.tensor is not None
            and "group" in message.meta
            and self._batcher is not None
        ):
            batch = BatchTokenMeta.model_validate(dict(message.meta))
            tokens = np.frombuffer(message.tensor.data, dtype=np.int32).tolist()
            self._batcher.on_tokens(batch.group, batch.seqs, tokens, batch.logprobs)
        elif message.kind is MessageKind.ERROR:
            self._failed(link, message.meta)
        elif message.kind is MessageKind.TOKENS and message.tensor is not None:
            meta = TokenMeta.model_validate(dict(message.meta))
            token = int(np.frombuffer(message.tensor.data, dtype=np.int32)[0])
            queue = self._queues.get(meta.seq)
            if queue is not None:
                top = tuple(meta.top) if meta.top is not None else None
                queue.put_nowait(TokenEvent(token=token, logprob=meta.logprob, top=top))
        elif message.kind is MessageKind.CONTROL:
            parse_control(message.meta)  # a heartbeat: receiving it was the point

    def _failed(self, link: StageLink, meta: Any) -> None:
        """A stage could not compute some sequences: their requests fail, nothing else."""
        if "group" in meta:
            group = GroupFailure.model_validate(dict(meta))
            if self._batcher is not None:
                self._batcher.fail_group(group.group, f"stage {link.node.id}: {group.message}")
            return
        failure = SequenceFailure.model_validate(dict(meta))
        queue = self._queues.get(failure.seq)
        if queue is not None:
            queue.put_nowait(
                SequenceFailed(f"stage {failure.stage} failed on this request: {failure.message}")
            )
