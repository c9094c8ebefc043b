"""Continuous batching of decode steps into micro-batches (coordinator side).

Each decoding sequence belongs to one micro-batch group. A group's step goes out as one batched
forward pass when every current member has its next token; a member that finishes leaves, a
newly prefilled sequence joins, both at step boundaries. Several groups are in flight at once,
so every stage has work while the others compute.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from mlxppd.core.protocol.pipeline import MAX_MICRO_BATCH, regroup
from mlxppd.runtime.backends.contract import BackendUnavailable, SequenceFailed, TokenEvent

#: (group, members, step, tokens, logprobs wanted, no other group in flight)
SendGroup = Callable[[str, list[str], int, np.ndarray, bool, bool], Awaitable[None]]


@dataclass
class _Group:
    gid: str
    members: list[str] = field(default_factory=list)
    joining: list[str] = field(default_factory=list)
    inputs: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, asyncio.Future[TokenEvent]] = field(default_factory=dict)
    logprobs: set[str] = field(default_factory=set)
    in_flight: bool = False
    step: int = 0

    @property
    def load(self) -> int:
        return len(self.members) + len(self.joining)


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

    def leave(self, seq: str) -> None:
        """The sequence is done (finished, cancelled or failed): drop it from its group."""
        group = self._groups.get(self._group_of.pop(seq, ""))
        if group is None:
            return
        for members in (group.members, group.joining):
            if seq in members:
                members.remove(seq)
        group.inputs.pop(seq, None)
        group.logprobs.discard(seq)
        future = group.waiting.pop(seq, None)
        if future is not None and not future.done():
            future.cancel()
        if not group.members and not group.joining and not group.in_flight:
            del self._groups[group.gid]
        else:
            self._maybe_dispatch(group)

    def on_tokens(
        self, gid: str, seqs: list[str], tokens: list[int], logprobs: list[float | None] | None
    ) -> None:
        """The last stage's answer to one group step."""
        group = self._groups.get(gid)
        if group is None:
            return
        group.in_flight = False
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            future = group.waiting.pop(seq, None)
            if future is not None and not future.done():
                lp = logprobs[i] if logprobs is not None else None
                future.set_result(TokenEvent(token=token, logprob=lp))
        if not group.members and not group.joining:
            del self._groups[gid]
            return
        self._maybe_dispatch(group)

    def fail_group(self, gid: str, reason: str) -> None:
        """A stage could not run this group's step: its members' requests fail."""
        group = self._groups.pop(gid, None)
        if group is None:
            return
        for seq in group.members + group.joining:
            self._group_of.pop(seq, None)
        for future in group.waiting.values():
            if not future.done():
                future.set_exception(SequenceFailed(f"micro-batch failed: {reason}"))

    def fail(self, error: Exception) -> None:
        """The pipeline is gone: every waiting step gets ``error``, and so does every later one."""
        self._broken = error
        for group in self._groups.values():
            for future in group.waiting.values():
                if not future.done():
                    future.set_exception(error)
            group.waiting.clear()

    def _place(self, seq: str) -> _Group:
        open_groups = [g for g in self._groups.values() if g.load < (self.size or MAX_MICRO_BATCH)]
        if self.size == 0:
            # Auto: one group per stage, balanced.
            full = len(self._groups) >= self.stages
            group = min(open_groups, key=lambda g: g.load) if open_groups and full else None
        else:
            # Fill the fullest group that still has room, so groups stay few and large.
            group = max(open_groups, key=lambda g: g.load) if open_groups else None
        if group is None:
            group = _Group(gid=f"g{next(self._ids)}")
            self._groups[group.gid] = group
        group.joining.append(seq)
        self._group_of[seq] = group.gid
        return group

    def _maybe_dispatch(self, group: _Group) -> None:
        if group.in_flight or self._broken is not None:
            return
        if any(s not in group.inputs for s in group.members):
            return  # a member's previous token is still on its way to its client
        ready_joiners = [s for s in group.joining if s in group.inputs]
        order = regroup(group.members, group.members + ready_joiners)
        if not order:
            return
        tokens = np.asarray([[group.inputs.pop(s)] for s in order], dtype=np.int32)
        group.members = order
        group.joining = [s for s in group.joining if s not in set(ready_joiners)]
        group.in_flight = True
        step = group.step
        group.step += 1
        want_logprobs = any(s in group.logprobs for s in order)
        alone = not any(g.in_flight for g in self._groups.values() if g is not group)
        task = asyncio.ensure_future(
            self._send(group.gid, order, step, tokens, want_logprobs, alone)
        )
        task.add_done_callback(lambda t: self._sent(t, group))

    def _sent(self, task: asyncio.Future[None], group: _Group) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(
                BackendUnavailable(f"sending micro-batch {group.gid} failed: {task.exception()}")
            )
