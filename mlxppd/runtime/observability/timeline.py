"""The start of a cluster as it happened: what became ready when (stages listening, the
coordinator connected to each, the identity check, the warm-up, the HTTP API). The web
console shows it; each part of the start marks its own moment."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

#: marks kept; a coordinator that reconnects many times keeps its latest ones
MAX_MARKS = 64


@dataclass(frozen=True)
class Mark:
    at: float
    """wall clock, seconds since the epoch"""
    what: str
    """one sentence, e.g. "stage 0 (stage-0) listening on 127.0.0.1:19001\""""


class StartTimeline:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._marks: list[Mark] = []

    def mark(self, what: str) -> None:
        self._marks.append(Mark(self._clock(), what))
        del self._marks[:-MAX_MARKS]

    def to_json(self) -> list[dict[str, object]]:
        return [{"at": round(m.at, 3), "what": m.what} for m in self._marks]
