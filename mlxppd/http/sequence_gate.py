"""The coordinator's cap on sequences in flight, per client fair share, on the event loop.

``core/fair_share.py`` decides; this module keeps its current ``Shares``, parks the requests
told to wait on futures (each for at most ``wait_s`` seconds), counts into the metrics and
turns a refusal into the API's 503 with Retry-After. A handler calls ``admit_sequences`` once
it knows how many sequences its request creates (the choices of ``n``); the base app's
middleware releases them when the request ends, whatever way it ends (``http/base_app.py``).
The client is the peer address: one API key is shared by every client of a server.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from aiohttp import web

from mlxppd.core import fair_share
from mlxppd.core.fair_share import Ask, Shares, Verdict
from mlxppd.http.errors import ADMISSION_RETRY_AFTER_S, ApiError
from mlxppd.runtime.observability.metrics import PipelineMetrics

#: seconds a request within its share waits for room before it is refused with a 503
DEFAULT_SEQUENCE_WAIT_S = 30.0


@dataclass(frozen=True)
class Held:
    """Sequences one request holds until the middleware releases them."""

    client: str
    count: int


class SequenceGate:
    def __init__(
        self,
        capacity: int,
        *,
        max_waiting: int | None = None,
        wait_s: float = DEFAULT_SEQUENCE_WAIT_S,
        metrics: PipelineMetrics | None = None,
    ) -> None:
        """``capacity`` sequences at once; ``max_waiting`` requests queued (default: as many
        as the capacity); each waits ``wait_s`` seconds at most."""
        self.shares = Shares(capacity, capacity if max_waiting is None else max_waiting)
        self.wait_s = wait_s
        self._metrics = metrics
        self._tickets = itertools.count()
        self._waiters: dict[int, asyncio.Future[None]] = {}

    async def admit(self, client: str, count: int) -> Held:
        """``count`` sequences for ``client``, now or once there is room; an ``ApiError``
        (503, 400 for more than the capacity) when refused."""
        request = Ask(next(self._tickets), client, count)
        self.shares, verdict = fair_share.ask(self.shares, request)
        if verdict is Verdict.ADMITTED:
            self._changed()
            return Held(client, count)
        if verdict is not Verdict.WAITING:
            raise self._refusal(request, verdict)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[request.ticket] = future
        self._changed()
        try:
            await asyncio.wait({future}, timeout=self.wait_s)
        except BaseException:
            # The handler was cancelled while it waited: give back what it was just given.
            if future.done() and not future.cancelled():
                self.release(Held(client, count))
            raise
        finally:
            self._waiters.pop(request.ticket, None)
            if not future.done():  # its deadline passed, or its handler was cancelled
                future.cancel()
                self.shares, admitted = fair_share.cancel(self.shares, request.ticket)
                self._wake(admitted)
        if future.cancelled():
            raise self._refusal(request, None)
        return Held(client, count)

    def release(self, held: Held) -> None:
        self.shares, admitted = fair_share.release(self.shares, held.client, held.count)
        self._wake(admitted)

    def _wake(self, admitted: tuple[Ask, ...]) -> None:
        for request in admitted:
            future = self._waiters.get(request.ticket)
            if future is not None and not future.done():
                future.set_result(None)
        self._changed()

    def _changed(self) -> None:
        if self._metrics is not None:
            self._metrics.sequences_in_flight.set(self.shares.in_use)
            self._metrics.sequences_waiting.set(len(self.shares.waiting))

    def _refusal(self, request: Ask, verdict: Verdict | None) -> ApiError:
        """The 503 (or 400) of a refused ``request``; ``verdict`` None: its wait ran out."""
        reason = verdict.value if verdict is not None else "queue_timeout"
        if self._metrics is not None:
            self._metrics.sequences_refused.labels(reason=reason).inc()
        shares = self.shares
        if verdict is Verdict.TOO_MANY:
            return ApiError(
                400,
                f"the request creates {request.count} sequences and the server runs at most "
                f"{shares.per_client} at once for one client; ask for fewer choices (n)",
                param="n",
                code="too_many_sequences",
            )
        if verdict is Verdict.OVER_SHARE and shares.fits(request.count):
            message = (
                f"this client holds {shares.holding(request.client)} of the "
                f"{shares.capacity} sequences the server runs at once, and one client may hold "
                f"{shares.per_client} (the rest is kept for other clients); retry when its "
                "requests have ended"
            )
        elif verdict is Verdict.OVER_SHARE:
            message = (
                f"the server is running all the {shares.capacity} sequences it runs at once and "
                f"this client holds {shares.holding(request.client)} of them, its fair share "
                f"being {shares.share(request.client)}; retry when its requests have ended"
            )
        elif verdict is Verdict.QUEUE_FULL:
            message = (
                f"the server is running all the {shares.capacity} sequences it runs at once and "
                f"{len(shares.waiting)} requests wait for room; retry shortly"
            )
        else:
            message = (
                f"the request waited {self.wait_s:g} s for room among the {shares.capacity} "
                "sequences the server runs at once; retry shortly"
            )
        return ApiError(
            503,
            message,
            type="server_overloaded",
            code=reason,
            headers={"Retry-After": str(ADMISSION_RETRY_AFTER_S)},
        )


def client_of(request: web.Request) -> str:
    """Whose share a request counts against: its peer's address."""
    return request.remote or "-"
