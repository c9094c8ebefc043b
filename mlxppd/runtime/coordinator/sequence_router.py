"""Where each sequence's tokens go: its own queue, or its micro-batch group's future.

The coordinator opens a queue per running sequence; decode steps of sequences that share a
micro-batch travel as one group (``micro_batcher.py``). What the last stage sends back is
routed here by the link reader; a lost pipeline fails every queue and group at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from mlxppd.core.protocol.pipeline import BatchTokenMeta, GroupFailure, SequenceFailure, TokenMeta
from mlxppd.runtime.backends.contract import SequenceFailed, TokenEvent
from mlxppd.runtime.coordinator.micro_batcher import MicroBatcher, SendGroup
from mlxppd.wire.codec import Message, MessageKind

Item = TokenEvent | Exception


class SequenceRouter:
    """The queues of the running sequences and the micro-batcher of their decode steps."""

    def __init__(self, micro_batch_size: int, send_group: SendGroup, stages: int) -> None:
        #: 1: no micro-batches; 0: auto (micro_batcher.py)
        self._size = micro_batch_size
        self._send_group = send_group
        self.queues: dict[str, asyncio.Queue[Item]] = {}
        self.batcher = self._new_batcher(stages)

    def _new_batcher(self, stages: int) -> MicroBatcher | None:
        if self._size == 1:
            return None
        return MicroBatcher(self._size, self._send_group, stages)

    def reset(self, stages: int) -> None:
        """A new pipeline: the old groups' caches went with the old one."""
        if self.batcher is not None:
            self.batcher = self._new_batcher(stages)

    def open(self, seq: str) -> asyncio.Queue[Item]:
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self.queues[seq] = queue
        return queue

    def leave(self, seq: str) -> asyncio.Future[None] | None:
        """``seq`` takes no more decode steps in its micro-batch. The future is done once the
        stages may free it (None: it was in no micro-batch)."""
        if self.batcher is not None and self.batcher.holds(seq):
            return self.batcher.leave(seq)
        return None

    def close(self, seq: str) -> asyncio.Future[None] | None:
        """``seq`` is done: no more tokens are routed to it (see ``leave`` for the future)."""
        self.queues.pop(seq, None)
        return self.leave(seq)

    def fail_all(self, error: Exception) -> None:
        """Every running sequence sees ``error`` next."""
        for queue in self.queues.values():
            queue.put_nowait(error)
        if self.batcher is not None:
            self.batcher.fail(error)

    def deliver(self, node_id: str, message: Message) -> None:
        """A message of the pipeline from stage ``node_id``: tokens, or failed sequences."""
        if message.kind is MessageKind.ERROR:
            self._failed(node_id, message.meta)
        elif message.kind is not MessageKind.TOKENS or message.tensor is None:
            return
        elif "group" in message.meta and self.batcher is not None:
            batch = BatchTokenMeta.model_validate(dict(message.meta))
            tokens = np.frombuffer(message.tensor.data, dtype=np.int32).tolist()
            self.batcher.on_tokens(
                batch.group, batch.seqs, tokens, batch.logprobs, batch.tops, batch.more
            )
        else:
            meta = TokenMeta.model_validate(dict(message.meta))
            token = int(np.frombuffer(message.tensor.data, dtype=np.int32)[0])
            queue = self.queues.get(meta.seq)
            if queue is not None:
                top = tuple(meta.top) if meta.top is not None else None
                queue.put_nowait(TokenEvent(token=token, logprob=meta.logprob, top=top))

    def _failed(self, node_id: str, meta: Any) -> None:
        """A stage could not compute some sequences: their requests fail, nothing else."""
        if "group" in meta:
            group = GroupFailure.model_validate(dict(meta))
            if self.batcher is not None:
                self.batcher.fail_group(group.group, f"stage {node_id}: {group.message}")
            return
        failure = SequenceFailure.model_validate(dict(meta))
        error = SequenceFailed(f"stage {failure.stage} failed on this request: {failure.message}")
        if self.batcher is not None and self.batcher.fail_member(failure.seq, error):
            return  # it failed inside its micro-batch; the group goes on
        queue = self.queues.get(failure.seq)
        if queue is not None:
            queue.put_nowait(error)
