"""What the web console shows, gathered in one place (``http/console.py`` serves it).

A snapshot is the admin status document with its health badge (``ConsoleStatus``: the model
of ``core/status_document.py``, each stage card with its busy and bubble fractions added), the
layer plan as bytes against budgets, the history of repartitions, failovers and prepares, the
start timeline and the chart series. The feed samples the metrics every ``interval_s`` (so the
charts cover the last minutes before a page opened) and, while a page listens, builds one
snapshot per tick and hands it to every listener: one status round trip to the stages per tick,
however many pages are open.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from pydantic import Field

from mlxppd.core.console_series import Point, Reading, point_between
from mlxppd.core.errors import MlxppError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.partition.plan import balance_layers, parse_stage_memory, plan_layers
from mlxppd.core.profile.model import ModelProfile
from mlxppd.core.status_document import StageCard, StatusDocument
from mlxppd.core.strict import StrictModel
from mlxppd.http.admin_api import AdminController, status_document
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.timeline import StartTimeline

log = logging.getLogger("mlxppd.http.console")

#: seconds between two samples (and two pushes to open pages)
INTERVAL_S = 1.0
#: chart points kept: five minutes at one a second
KEEP_POINTS = 300
#: pages listening at once; more get a 503 (each costs one queue, not a status round trip)
MAX_LISTENERS = 32
#: the most stages a what-if plan may ask for
MAX_WHAT_IF_STAGES = 256


class WhatIf(StrictModel):
    """The body of POST /console/v1/plan: the plan the partitioner would make."""

    stages: int = Field(ge=1, le=MAX_WHAT_IF_STAGES, description="pipeline stages")
    stage_memory: str | None = Field(
        None, min_length=1, max_length=4096, description='budget per stage, e.g. "8GiB,4GiB"'
    )


class ConsoleStageCard(StageCard):
    """A stage card as the console shows it: the admin document's, with the stage's share of
    the metrics' window."""

    busy_fraction: float | None = Field(ge=0, le=1)
    """the fraction of wall time the stage computed; null without metrics for it"""
    bubble_fraction: float | None = Field(ge=0, le=1)
    """the fraction of the time it held sequences that it waited for input; null likewise"""


class ConsoleStatus(StatusDocument):
    """The status document of ``GET /console/v1/state`` and the stream's ticks."""

    stages: tuple[ConsoleStageCard, ...]
    """the pipeline as it serves now, in stage order, with busy and bubble fractions"""


class ConsoleFeed:
    def __init__(
        self,
        controller: AdminController,
        metrics: PipelineMetrics | None,
        profile: ModelProfile | None,
        timeline: StartTimeline | None = None,
        *,
        float32_profile: ModelProfile | None = None,
        clock: Callable[[], float] = time.time,
        interval_s: float = INTERVAL_S,
        keep: int = KEEP_POINTS,
    ) -> None:
        self.controller = controller
        self.metrics = metrics
        self.profile = profile
        # What-if plans price the weights as the stages hold them (float32 on a CPU host).
        self._float32_profile = float32_profile
        self._held = "native"
        self.timeline = timeline
        self.interval_s = interval_s
        self._clock = clock
        self._points: collections.deque[Point] = collections.deque(maxlen=keep)
        self._last: Reading | None = None
        self._listeners: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._closed = False

    # -- the series ------------------------------------------------------------------------

    def reading(self) -> Reading:
        """The metrics' counters now (zeros without metrics)."""
        m = self.metrics
        if m is None:
            return Reading(self._clock(), 0.0, 0.0, 0.0, 0.0)
        requests = sum(
            s.value
            for family in m.requests.collect()
            for s in family.samples
            if s.name.endswith("_total") and s.labels.get("endpoint", "").startswith("/v1/")
        )
        ttft = {s.name: s.value for family in m.ttft.collect() for s in family.samples}
        tokens = sum(
            s.value
            for family in m.generation_tokens.collect()
            for s in family.samples
            if s.name.endswith("_total")
        )
        busy = tuple((v.report.stage, v.busy_fraction) for v in m.stage_view())
        return Reading(
            at=self._clock(),
            tokens=tokens,
            requests=requests,
            ttft_sum=ttft.get("mlxpp_time_to_first_token_seconds_sum", 0.0),
            ttft_count=ttft.get("mlxpp_time_to_first_token_seconds_count", 0.0),
            busy=busy,
        )

    def sample(self) -> Point | None:
        """Take a reading; the point since the last one (None for the first)."""
        now = self.reading()
        point = point_between(self._last, now) if self._last is not None else None
        self._last = now
        if point is not None:
            self._points.append(point)
        return point

    def series(self) -> list[dict[str, object]]:
        return [p.to_json() for p in self._points]

    # -- snapshots -------------------------------------------------------------------------

    async def snapshot(self, *, series: bool = True) -> dict[str, Any]:
        """Everything the page shows; ``series``: the whole chart history, else none (a tick
        carries only its new point)."""
        status = await self.status()
        events = (await self.controller.events(-1)).model_dump(mode="json")["events"]
        self._held = "float32" if any(c.weights == "float32" for c in status.stages) else "native"
        document: dict[str, Any] = {
            "at": round(self._clock(), 3),
            "status": status.model_dump(mode="json"),
            "plan": self.current_plan(status),
            "repartitions": events,
            "timeline": self.timeline.to_json() if self.timeline is not None else [],
        }
        if series:
            document["series"] = self.series()
        return document

    async def status(self) -> ConsoleStatus:
        """The admin status document, each stage card with its busy and bubble fractions."""
        document = status_document(await self.controller.status())
        views = {v.report.stage: v for v in self.metrics.stage_view()} if self.metrics else {}
        cards = []
        for card in document.stages:
            view = views.get(card.stage) if card.stage is not None else None
            cards.append(
                ConsoleStageCard(
                    **dict(card),
                    busy_fraction=round(view.busy_fraction, 4) if view else None,
                    bubble_fraction=round(view.bubble_fraction, 4) if view else None,
                )
            )
        return ConsoleStatus(**{**dict(document), "stages": tuple(cards)})

    def current_plan(self, status: StatusDocument) -> dict[str, object] | None:
        """The plan in force as bars: each stage's weight bytes (as it reported them, else
        the estimate from config.json) against its memory budget, with the partitioner's
        warnings for it."""
        profile = self._profile()
        if profile is None:
            return None
        cards = [c for c in status.stages if c.layers]
        try:
            ranges = [LayerRange(int(a), int(b) + 1) for a, b in
                      (str(c.layers).split("-") for c in cards)]  # fmt: skip
            budgets = [c.memory_budget_bytes for c in cards]
            plan = plan_layers(profile, ranges, budgets) if ranges else None
        except (MlxppError, ValueError):
            return None  # a card mid-move; the next tick has a consistent chain
        if plan is None:
            return None
        stages = []
        for card, assigned in zip(cards, plan.stages, strict=True):
            held = card.parameter_bytes
            stages.append(
                {
                    "stage": card.stage,
                    "node_id": card.node_id,
                    "layers": card.layers,
                    "bytes": held if held is not None else assigned.estimated_memory_bytes,
                    "measured": held is not None,
                    "budget_bytes": assigned.budget_bytes,
                }
            )
        # The coordinator's own pre-launch warnings (an empty list too).
        return {"stages": stages, "warnings": list(status.coordinator.warnings)}

    def what_if(self, request: WhatIf) -> dict[str, Any]:
        """The plan the partitioner would make for ``request``; nothing changes. Raises
        MlxppError with its sentence when it cannot be made."""
        profile = self._profile()
        if profile is None:
            raise MlxppError("this coordinator has no model profile to plan with")
        budgets = (
            parse_stage_memory(request.stage_memory, request.stages)
            if request.stage_memory
            else None
        )
        plan = balance_layers(profile, request.stages, budgets)
        return {
            "weights": self._held,
            "stages": [
                {
                    "stage": s.stage_index,
                    "layers": f"{s.layer_range.start}-{s.layer_range.end - 1}",
                    "bytes": s.estimated_memory_bytes,
                    "measured": False,
                    "budget_bytes": s.budget_bytes,
                }
                for s in plan.stages
            ],
            "warnings": list(plan.warnings),
        }

    def _profile(self) -> ModelProfile | None:
        """The profile priced as the stages hold their weights (float32 on a CPU host)."""
        if self._held == "float32" and self._float32_profile is not None:
            return self._float32_profile
        return self.profile

    # -- listeners -------------------------------------------------------------------------

    def listen(self) -> asyncio.Queue[dict[str, Any] | None] | None:
        """A queue of ticks for one page (None in it: the server is stopping), or None when
        ``MAX_LISTENERS`` pages listen."""
        if len(self._listeners) >= MAX_LISTENERS or self._closed:
            return None
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=4)
        self._listeners.add(queue)
        return queue

    def leave(self, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._listeners.discard(queue)

    def close(self) -> None:
        """End every page's stream (the server stops: an open page must not hold it up)."""
        self._closed = True
        for queue in self._listeners:
            while True:
                try:
                    queue.put_nowait(None)
                    break
                except asyncio.QueueFull:
                    queue.get_nowait()  # drop a tick: the end matters more

    async def run(self) -> None:
        """Sample every ``interval_s``; while pages listen, push each a tick."""
        while True:
            point = self.sample()
            if self._listeners:
                try:
                    tick = await self.snapshot(series=False)
                except Exception:  # one bad tick must not end the console's feed
                    log.exception("console: building the status failed")
                else:
                    tick["point"] = point.to_json() if point is not None else None
                    for queue in list(self._listeners):
                        with contextlib.suppress(asyncio.QueueFull):  # a slow page skips one
                            queue.put_nowait(tick)
            await asyncio.sleep(self.interval_s)
