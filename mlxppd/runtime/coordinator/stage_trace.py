"""Fetching a stage's trace events onto this node's clock (for the merged trace file)."""

from __future__ import annotations

import time

from pydantic import ValidationError

from mlxppd.core.protocol.control import (
    StageReport,
    Status,
    TraceDump,
    TraceReply,
    parse_trace_events,
)
from mlxppd.runtime.coordinator.chain import StageChain
from mlxppd.runtime.coordinator.stage_link import StageLink


async def stage_trace_events(chain: StageChain, link: StageLink) -> list[dict[str, object]]:
    """The stage's recorded events (which it then forgets), timestamps moved onto our clock.

    The offset is estimated from a status round trip: the stage read its clock about halfway
    through it.
    """
    sent = time.time()
    status = await chain.ask(link, Status(), StageReport)
    offset_us = (status.now - (sent + time.time()) / 2) * 1e6
    _, payload = await chain.ask_with_payload(link, TraceDump(), TraceReply)
    try:
        events = parse_trace_events(payload)
    except ValidationError as exc:
        raise chain.lost(link, f"malformed trace events: {exc.errors()[0]['msg']}") from None
    return [{**e.model_dump(exclude_none=True), "ts": e.ts - offset_us} for e in events]
