"""Server-sent events the way OpenAI streams: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``,
with named events as Anthropic streams them; ``failures_end_stream`` around a stream turns a
failure after its headers into its last event."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from mlxppd.http.base_app import request_log
from mlxppd.http.completion import ClientGone
from mlxppd.http.errors import ApiError, from_backend_error
from mlxppd.runtime.backends.contract import AdmissionRejected, BackendUnavailable

log = logging.getLogger("mlxppd.http")


def _encode(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class SseWriter:
    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request, headers: dict[str, str]) -> SseWriter:
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                # Reverse proxies (nginx) would otherwise buffer the stream.
                "X-Accel-Buffering": "no",
                **headers,
            },
        )
        await response.prepare(request)
        return cls(response)

    async def _write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionError as exc:  # aiohttp's reset errors subclass it
            raise ClientGone() from exc

    async def event(self, payload: Any) -> None:
        await self._write(_encode(payload))

    async def named(self, name: str, payload: Any) -> None:
        """An event with a name (``event: name``), as EventSource listeners select them."""
        await self._write(b"event: " + name.encode() + b"\n" + _encode(payload))

    async def comment(self, text: str) -> None:
        """A comment line: keeps the stream alive, seen by no listener."""
        await self._write(b": " + text.encode() + b"\n\n")

    async def done(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        await self.close()

    async def close(self) -> None:
        try:
            await self.response.write_eof()
        except ConnectionError as exc:
            raise ClientGone() from exc


@contextlib.asynccontextmanager
async def failures_end_stream(
    request: web.Request, send_error: Callable[[ApiError], Awaitable[None]]
) -> AsyncIterator[None]:
    """Around a stream whose headers are sent: a closed client is noted in the request's log
    line; any other failure is logged and sent as the stream's last event (``send_error``, in
    the API's shape), so the client sees a failure rather than a silent end."""
    info = request_log(request)
    try:
        yield
    except ClientGone:
        info.note = "client closed the stream"
    except Exception as exc:
        error = from_backend_error(exc)
        if error.status >= 500 and not isinstance(exc, AdmissionRejected | BackendUnavailable):
            log.exception("%s stream failed", info.request_id)
        info.note = f"stream ended by error: {error.message}"
        with contextlib.suppress(ClientGone):
            await send_error(error)
