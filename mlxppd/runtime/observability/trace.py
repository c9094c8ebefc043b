"""Chrome / Perfetto trace events (Trace Event Format), buffered and written once.

Every node records on its wall clock in microseconds, so events of stages on one host (and of
hosts with synchronised clocks) line up in the coordinator's merged file; ``pid`` is the node,
``tid`` the stage index.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from mlxppd.runtime.system.atomic_write import write_text_atomic

log = logging.getLogger("mlxppd.trace")

#: events one node keeps before dropping new ones (bounded memory on long runs)
MAX_EVENTS = 200_000


def now_us() -> float:
    return time.time() * 1e6


class TraceBuffer:
    def __init__(self, pid: str, enabled: bool = True, max_events: int = MAX_EVENTS) -> None:
        self.pid = pid
        self.enabled = enabled
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        self.dropped = 0

    def _add(self, event: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        self.events.append(event)

    def span(self, name: str, tid: int, start_us: float, end_us: float, **args: Any) -> None:
        self._add(
            {"name": name, "ph": "X", "ts": start_us, "dur": max(0.0, end_us - start_us),
             "pid": self.pid, "tid": tid, "args": args}
        )  # fmt: skip

    def instant(self, name: str, tid: int, **args: Any) -> None:
        self._add(
            {"name": name, "ph": "i", "s": "t", "ts": now_us(), "pid": self.pid, "tid": tid,
             "args": args}
        )  # fmt: skip

    def take(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


class TraceFile:
    """The coordinator's merged trace: written once; a second flush does nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.written = False

    def flush(self, events: list[dict[str, Any]]) -> bool:
        if self.written:
            return False
        names = {e["pid"] for e in events}
        meta = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": pid}}
            for pid in sorted(names)
        ]
        trace = {"traceEvents": meta + sorted(events, key=lambda e: e["ts"])}
        write_text_atomic(self.path, json.dumps(trace))
        self.written = True
        log.info("trace: %d events written to %s", len(events), self.path)
        return True
