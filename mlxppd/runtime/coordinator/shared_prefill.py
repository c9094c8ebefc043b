"""The choices of one prompt (``n`` > 1) share its prefill on every stage.

The first choice (the leader) sends the prompt's head (all tokens but the last) with the other
choices' sequence ids attached to its last chunk; each stage, once it has run that chunk, copies
the leader's KV caches for each of them. Only then may a follower send its own last prompt
token: it waits for the leader's head to be on the wire (before it takes a generation slot,
so waiting followers never hold the slots a leader needs), and the stages run their input in
arrival order, so its caches are there when its token arrives. A leader that fails before the
head is sent lets the followers prefill the prompt themselves; a follower that never comes
releases its copies on every stage.
"""

from __future__ import annotations

import asyncio


class SharedPrefill:
    """The rendezvous of one prompt's choices: the leader and the followers' sequence ids."""

    def __init__(self, seqs: list[str]) -> None:
        """``seqs``: every choice's sequence id, the leader's first."""
        self.leader_seq = seqs[0]
        self.followers = seqs[1:]
        self.leader: str | None = None
        self._head_sent = asyncio.Event()

    def head_done(self, leader: str | None) -> None:
        """The leader sent the head (``leader``: its sequence id), or failed before (None):
        the followers then prefill on their own."""
        if not self._head_sent.is_set():
            self.leader = leader
            self._head_sent.set()

    async def source(self) -> str | None:
        """For a follower: the sequence whose head it holds a copy of (None: none)."""
        await self._head_sent.wait()
        return self.leader
