"""Who takes part in a decode micro-batch, step by step: the membership rules as values.

A sequence joins a group once its prefill is done (its first decode input is the token its
prefill sampled) and rides in every step from the next boundary on; it leaves when it finishes,
when its client closes, or when it fails alone. One rule carries the weight: a sequence that
leaves while a step carrying it is in flight is *leaving* until that step is answered, and only
then may the stages free it. (A release sent at once raced the step through the pipeline: the
stage that had freed the sequence failed the whole group's step.) A member a stage dropped
from a step fails alone; the group goes on without it.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from mlxppd.core.protocol.pipeline import regroup


class Phase(enum.Enum):
    JOINING = "joining"
    """prefilled, waiting for its first step in the group"""
    MEMBER = "member"
    """took part in the group's last step"""
    LEAVING = "leaving"
    """gone from the group, but a step carrying it is still in flight"""


@dataclass(frozen=True, slots=True)
class Answer:
    """What a group step's answer changes, beside the group itself."""

    group: GroupMembership
    released: tuple[str, ...] = ()
    """sequences that left during the step: the stages may free them now"""
    dropped: tuple[str, ...] = ()
    """members the answer lacks (a stage could not run them): they fail alone"""


@dataclass(frozen=True, slots=True)
class GroupMembership:
    """One micro-batch group's members in batch order, its joiners and its step in flight."""

    gid: str
    members: tuple[str, ...] = ()
    joining: tuple[str, ...] = ()
    in_flight: tuple[str, ...] = ()
    """the rows of the step on its way through the pipeline (empty: none)"""
    leaving: frozenset[str] = field(default_factory=frozenset)
    """left during the step in flight (always rows of ``in_flight``)"""
    step: int = 0

    @property
    def load(self) -> int:
        return len(self.members) + len(self.joining)

    @property
    def idle(self) -> bool:
        """No member, joiner or step in flight: the group can go."""
        return not self.members and not self.joining and not self.in_flight

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    def phase(self, seq: str) -> Phase | None:
        if seq in self.leaving:
            return Phase.LEAVING
        if seq in self.members:
            return Phase.MEMBER
        if seq in self.joining:
            return Phase.JOINING
        return None

    def join(self, seq: str) -> GroupMembership:
        """A prefilled sequence joins at the next step boundary."""
        if (phase := self.phase(seq)) is not None:
            raise ValueError(f"sequence {seq} is already {phase.value} in {self.gid}")
        return replace(self, joining=(*self.joining, seq))

    def leave(self, seq: str) -> tuple[GroupMembership, bool]:
        """``seq`` takes no more steps. True: the stages may free it now; False: a step
        carrying it is in flight, and the answer to that step releases it."""
        if seq in self.leaving:
            return self, False
        group = replace(
            self,
            members=tuple(s for s in self.members if s != seq),
            joining=tuple(s for s in self.joining if s != seq),
        )
        if seq in self.in_flight:
            return replace(group, leaving=self.leaving | {seq}), False
        return group, True

    def next_step(self, ready: Collection[str]) -> tuple[GroupMembership, tuple[str, ...]]:
        """The rows of the next step when it can go (every member ``ready`` with its next input,
        no step in flight); joiners that are ready ride along. Empty: not yet."""
        if self.in_flight or any(s not in ready for s in self.members):
            return self, ()
        joiners = [s for s in self.joining if s in ready]
        rows = tuple(regroup(list(self.members), [*self.members, *joiners]))
        if not rows:
            return self, ()
        group = replace(
            self,
            members=rows,
            joining=tuple(s for s in self.joining if s not in set(joiners)),
            in_flight=rows,
            step=self.step + 1,
        )
        return group, rows

    def answered(self, rows: Sequence[str]) -> Answer:
        """The last stage answered the step in flight with tokens for ``rows``."""
        if not self.in_flight:
            return Answer(self)  # a stale answer (an old pipeline's): nothing was waiting
        answered = set(rows)
        dropped = tuple(s for s in self.in_flight if s not in answered and s not in self.leaving)
        group = replace(
            self,
            members=tuple(s for s in self.members if s not in set(dropped)),
            in_flight=(),
            leaving=frozenset(),
        )
        released = tuple(s for s in self.in_flight if s in self.leaving)
        return Answer(group, released=released, dropped=dropped)

    def row_failed(self, seq: str) -> Answer:
        """A stage could not run ``seq`` (alone): it leaves the group, and its row of the step
        in flight is over (a stage that dropped every row sends no tokens for the step)."""
        group, _ = self.leave(seq)
        released = (seq,) if seq in self.in_flight else ()
        group = replace(
            group,
            in_flight=tuple(s for s in self.in_flight if s != seq),
            leaving=group.leaving - {seq},
        )
        return Answer(group, released=released)

    def everyone(self) -> tuple[str, ...]:
        """Every sequence the group still accounts for, leaving ones included."""
        return (*self.members, *self.joining, *sorted(self.leaving))
