"""Continuous batching of decode steps into micro-batches (coordinator side).

Each decoding sequence belongs to one micro-batch group. A group's step goes out as one batched
forward pass when every current member has its next token; a member that finishes leaves, a
newly prefilled sequence joins, both at step boundaries. Several groups are in flight at once,
so every stage has work while the others compute. Who is in a group when is decided by the pure
rules of ``core/batch_membership.py``; this module holds the inputs and futures around them.

A fixed ``size`` fills the fullest group with room first (groups of ``size``). Auto (size 0,
the default) keeps as many groups as there are stages and balances them: the first sequences
each start a group, later ones join the smallest, so ``n`` streams on ``k`` stages run as ``k``
groups of about ``n / k``: every stage computes one group while the others compute theirs, and
each pass carries as many rows as that allows (on a CPU or GPU a pass of 4 rows costs little
more than one of 1).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from mlxppd.core.batch_membership import GroupMembership
from mlxppd.core.protocol.pipeline import MAX_MICRO_BATCH
from mlxppd.runtime.backends.contract import BackendUnavailable, SequenceFailed, TokenEvent

#: (group, members, step, tokens, logprobs wanted, no other group in flight)
SendGroup = Callable[[str, list[str], int, np.ndarray, bool, bool], Awaitable[None]]


@dataclass
class _Group:
    state: GroupMembership
    inputs: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, asyncio.Future[TokenEvent]] = field(default_factory=dict)
    logprobs: set[str] = field(default_factory=set)
    #: leaving sequences: done once the step carrying them is answered
    settling: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    #: the rows of the step's answer received so far, while it comes in parts (``more``)
    parts: list[tuple[str, TokenEvent]] = field(default_factory=list)


def _done() -> asyncio.Future[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


class MicroBatcher:
    def __init__(self, size: int, send: SendGroup, stages: int = 1) -> None:
        """``size``: sequences per group, 0 for auto (``stages`` balanced groups)."""
        self.size = size
        self.stages = max(1, stages)
        self._send = send
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}
        self._ids = itertools.count()
        self._broken: Exception | None = None

    def submit(self, seq: str, token: int, logprobs: bool) -> asyncio.Future[TokenEvent]:
        """Queue ``token`` as the sequence's next input; the future gets the sampled token."""
        future: asyncio.Future[TokenEvent] = asyncio.get_running_loop().create_future()
        if self._broken is not None:
            future.set_exception(self._broken)
            return future
        group = self._groups.get(self._group_of.get(seq, ""))
        if group is None:
            group = self._place(seq)
        group.inputs[seq] = token
        group.waiting[seq] = future
        if logprobs:
            group.logprobs.add(seq)
        self._maybe_dispatch(group)
        return future

    def holds(self, seq: str) -> bool:
        return seq in self._group_of

    def leave(self, seq: str) -> asyncio.Future[None]:
        """The sequence is done (finished, cancelled or failed): it takes no more steps. The
        future is done once the stages may free it (no step carrying it is in flight)."""
        group = self._groups.get(self._group_of.get(seq, ""))
        if group is None or self._broken is not None:
            # A lost pipeline answers no step: nothing is in flight any more.
            self._group_of.pop(seq, None)
            return _done()
        group.state, now = group.state.leave(seq)
        group.inputs.pop(seq, None)
        group.logprobs.discard(seq)
        future = group.waiting.pop(seq, None)
        if future is not None and not future.done():
            future.cancel()
        if now:
            self._group_of.pop(seq, None)
            settled = _done()
        else:
            settled = group.settling.setdefault(seq, asyncio.get_running_loop().create_future())
        self._after_change(group)
        return settled

    def fail_member(self, seq: str, error: Exception) -> bool:
        """A stage could not run ``seq`` (alone): its step fails, the group goes on. False
        when ``seq`` is in no group here."""
        group = self._groups.get(self._group_of.get(seq, ""))
        if group is None:
            return False
        answer = group.state.row_failed(seq)
        group.state = answer.group
        self._group_of.pop(seq, None)
        group.inputs.pop(seq, None)
        group.logprobs.discard(seq)
        future = group.waiting.pop(seq, None)
        if future is not None and not future.done():
            future.set_exception(error)
        self._settle(group, answer.released)
        self._after_change(group)
        return True

    def on_tokens(
        self,
        gid: str,
        seqs: list[str],
        tokens: list[int],
        logprobs: list[float | None] | None,
        tops: Sequence[Sequence[tuple[int, float]] | None] | None = None,
        more: bool = False,
    ) -> None:
        """The last stage's answer to one group step: per member in batch order, its token,
        its logprob and its most likely tokens (``tops``: None where it asked none). ``more``:
        a part of the answer, whose other rows follow; the step is answered with the last."""
        group = self._groups.get(gid)
        if group is None:
            return
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            lp = logprobs[i] if logprobs is not None else None
            row = tops[i] if tops is not None else None
            top = tuple(row) if row is not None else None
            group.parts.append((seq, TokenEvent(token=token, logprob=lp, top=top)))
        if len(group.parts) > MAX_MICRO_BATCH:
            raise ValueError(f"an answer to micro-batch {gid} has more rows than a batch")
        if more:
            return
        rows, group.parts = group.parts, []
        answer = group.state.answered([seq for seq, _ in rows])
        group.state = answer.group
        for seq, event in rows:
            future = group.waiting.pop(seq, None)
            if future is not None and not future.done():
                future.set_result(event)
        for seq in answer.dropped:
            self._group_of.pop(seq, None)
            group.inputs.pop(seq, None)
            future = group.waiting.pop(seq, None)
            if future is not None and not future.done():
                future.set_exception(
                    SequenceFailed(f"a stage could not run this sequence in micro-batch {gid}")
                )
        self._settle(group, answer.released)
        self._after_change(group)

    def _settle(self, group: _Group, released: tuple[str, ...]) -> None:
        """Sequences whose last step is over: the stages may free them."""
        for seq in released:
            self._group_of.pop(seq, None)
            settled = group.settling.pop(seq, None)
            if settled is not None and not settled.done():
                settled.set_result(None)

    def fail_group(self, gid: str, reason: str) -> None:
        """A stage could not run this group's step: its members' requests fail."""
        group = self._groups.pop(gid, None)
        if group is None:
            return
        for seq in group.state.everyone():
            self._group_of.pop(seq, None)
        for future in group.waiting.values():
            if not future.done():
                future.set_exception(SequenceFailed(f"micro-batch failed: {reason}"))
        _settle_all(group)

    def fail(self, error: Exception) -> None:
        """The pipeline is gone: every waiting step gets ``error``, and so does every later one;
        leaving sequences are settled (their steps will not come back)."""
        self._broken = error
        for group in self._groups.values():
            for future in group.waiting.values():
                if not future.done():
                    future.set_exception(error)
            group.waiting.clear()
            _settle_all(group)

    def _place(self, seq: str) -> _Group:
        limit = self.size or MAX_MICRO_BATCH
        open_groups = [g for g in self._groups.values() if g.state.load < limit]
        if self.size == 0:
            # Auto: one group per stage, balanced.
            full = len(self._groups) >= self.stages
            group = min(open_groups, key=lambda g: g.state.load) if open_groups and full else None
        else:
            # Fill the fullest group that still has room, so groups stay few and large.
            group = max(open_groups, key=lambda g: g.state.load) if open_groups else None
        if group is None:
            group = _Group(GroupMembership(gid=f"g{next(self._ids)}"))
            self._groups[group.state.gid] = group
        group.state = group.state.join(seq)
        self._group_of[seq] = group.state.gid
        return group

    def _after_change(self, group: _Group) -> None:
        if group.state.idle and not group.settling:
            self._groups.pop(group.state.gid, None)
        else:
            self._maybe_dispatch(group)

    def _maybe_dispatch(self, group: _Group) -> None:
        if self._broken is not None:
            return
        step = group.state.step
        group.state, order = group.state.next_step(group.inputs.keys())
        if not order:
            return
        rows = list(order)
        tokens = np.asarray([[group.inputs.pop(s)] for s in rows], dtype=np.int32)
        want_logprobs = any(s in group.logprobs for s in rows)
        alone = not any(g.state.busy for g in self._groups.values() if g is not group)
        gid = group.state.gid
        task = asyncio.ensure_future(self._send(gid, rows, step, tokens, want_logprobs, alone))
        task.add_done_callback(lambda t: self._sent(t, gid))

    def _sent(self, task: asyncio.Future[None], gid: str) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(BackendUnavailable(f"sending micro-batch {gid} failed: {task.exception()}"))


def _settle_all(group: _Group) -> None:
    for settled in group.settling.values():
        if not settled.done():
            settled.set_result(None)
    group.settling.clear()
