"""The sequences the HTTP APIs run at once, shared fairly between clients when they are many.

A request creates one sequence per choice (``n``), and every sequence holds a row of every
stage's micro-batch and its KV cache until it ends: the coordinator's cap counts sequences, not
requests. No client holds more than the capacity less a reserve of an eighth (``per_client``):
whoever comes next finds room at once, however busy one client keeps the pipeline. While there
is room, a request is admitted at once. When there is not, a client holding more than its fair
share (the capacity divided among the clients holding or waiting for sequences) is refused (the
HTTP layer answers 503 with Retry-After), and one within its share waits in a bounded queue.
Freed sequences go to the waiting request whose client holds the fewest, the oldest first: a
client that keeps asking cannot starve one that asks once.

``Shares`` is a frozen value; ``ask``, ``release`` and ``cancel`` return the next one (the HTTP
side, ``http/sequence_gate.py``, holds the current one and the waiters' futures).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

#: choices (``n``) one request may ask for by default: each is a row of every stage's batch
DEFAULT_MAX_CHOICES_PER_REQUEST = 4
#: the most an operator may allow (the request models' bound on ``n``)
MAX_CHOICES_PER_REQUEST = 16


def per_client(capacity: int) -> int:
    """The most sequences one client may hold of ``capacity``: all but a reserve of an eighth
    (at least one), so that the next client finds room at once."""
    return capacity - (max(1, capacity // 8) if capacity > 1 else 0)


class Verdict(enum.Enum):
    """What becomes of an ask."""

    ADMITTED = "admitted"
    WAITING = "waiting"
    #: the pipeline is full and the client holds its share of it, or more
    OVER_SHARE = "over_share"
    #: the pipeline is full and the queue too
    QUEUE_FULL = "queue_full"
    #: more sequences than one client may ever hold: it could never run
    TOO_MANY = "too_many"


@dataclass(frozen=True)
class Ask:
    """One request's sequences (``count``) for ``client``, numbered by ``ticket``."""

    ticket: int
    client: str
    count: int


@dataclass(frozen=True)
class Shares:
    #: sequences in flight at most (>= 1)
    capacity: int
    #: requests that may wait for room at once (0: none waits, the full pipeline refuses)
    max_waiting: int
    #: (client, sequences it holds), clients holding none left out
    held: tuple[tuple[str, int], ...] = ()
    #: the requests waiting, in arrival order
    waiting: tuple[Ask, ...] = ()

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"the sequence capacity must be at least 1, not {self.capacity}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be 0 or more, not {self.max_waiting}")

    @property
    def in_use(self) -> int:
        return sum(n for _, n in self.held)

    @property
    def per_client(self) -> int:
        """The most sequences one client may hold (``per_client(capacity)``)."""
        return per_client(self.capacity)

    def holding(self, client: str) -> int:
        return dict(self.held).get(client, 0)

    def share(self, client: str) -> int:
        """The sequences ``client`` may hold while others wait: the capacity divided among the
        clients holding or waiting (``client`` counted), at least one."""
        clients = {c for c, _ in self.held} | {a.client for a in self.waiting} | {client}
        return max(1, self.capacity // len(clients))

    def held_after(self, client: str, delta: int) -> tuple[tuple[str, int], ...]:
        """``held`` once ``client`` holds ``delta`` more (or fewer) sequences."""
        counts = dict(self.held)
        counts[client] = counts.get(client, 0) + delta
        if counts[client] < 0:
            raise ValueError(f"{client} releases more sequences than it holds")
        return tuple((c, n) for c, n in counts.items() if n > 0)

    def fits(self, count: int) -> bool:
        """``count`` more sequences fit now."""
        return self.in_use + count <= self.capacity

    def next_waiting(self) -> Ask | None:
        """The waiting request served first: its client holds the fewest, then the oldest."""
        if not self.waiting:
            return None
        return min(self.waiting, key=lambda a: (self.holding(a.client), a.ticket))


def ask(shares: Shares, request: Ask) -> tuple[Shares, Verdict]:
    """``request`` admitted, queued or refused."""
    if request.count > shares.per_client:
        return shares, Verdict.TOO_MANY
    if shares.holding(request.client) + request.count > shares.per_client:
        return shares, Verdict.OVER_SHARE
    if shares.fits(request.count):
        # Room now: it goes ahead unless a waiting request would be served before it.
        first = replace(shares, waiting=(*shares.waiting, request)).next_waiting()
        if first is None or first.ticket == request.ticket:
            held = shares.held_after(request.client, request.count)
            return replace(shares, held=held), Verdict.ADMITTED
    if shares.holding(request.client) + request.count > shares.share(request.client):
        return shares, Verdict.OVER_SHARE
    if len(shares.waiting) >= shares.max_waiting:
        return shares, Verdict.QUEUE_FULL
    return replace(shares, waiting=(*shares.waiting, request)), Verdict.WAITING


def release(shares: Shares, client: str, count: int) -> tuple[Shares, tuple[Ask, ...]]:
    """``client``'s ``count`` sequences ended; the waiting requests admitted into the room."""
    return _admit_waiting(replace(shares, held=shares.held_after(client, -count)))


def cancel(shares: Shares, ticket: int) -> tuple[Shares, tuple[Ask, ...]]:
    """The waiting request ``ticket`` gave up (its deadline, its client gone); the requests
    that it stood in front of and that fit now are admitted."""
    waiting = tuple(a for a in shares.waiting if a.ticket != ticket)
    return _admit_waiting(replace(shares, waiting=waiting))


def _admit_waiting(shares: Shares) -> tuple[Shares, tuple[Ask, ...]]:
    admitted: list[Ask] = []
    # In fairness order, while the next one fits: a large request is not overtaken for ever
    # by small ones behind it.
    while (first := shares.next_waiting()) is not None and shares.fits(first.count):
        shares = replace(
            shares,
            held=shares.held_after(first.client, first.count),
            waiting=tuple(a for a in shares.waiting if a.ticket != first.ticket),
        )
        admitted.append(first)
    return shares, tuple(admitted)
