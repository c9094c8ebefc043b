"""At most one log line per interval for events a peer can cause at will.

A flood of bad connections must not become a flood of log lines: the first event logs at once,
the ones within the next ``interval_s`` are only counted, and the next line that is due carries
their counts.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable


class LogThrottle:
    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")
        self._pending: Counter[str] = Counter()

    def note(self, what: str) -> str | None:
        """Count one ``what``; when a line is due now, the counts since the last one
        (``"3 bad_magic, 1 timeout"``), else None."""
        self._pending[what] += 1
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self.interval_s
        counts = ", ".join(f"{n} {why}" for why, n in sorted(self._pending.items()))
        self._pending.clear()
        return counts
