"""Server-sent events the way OpenAI streams: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``,
with named events as Anthropic streams them; ``failures_end_stream`` around a stream turns a
failure after its headers into its last event.

A client that stops reading must not hold anything: ``StreamFeed`` pulls a stream's generations
into a bounded buffer on tasks of their own, so no micro-batch group waits on a slow reader
(a sequence's tokens queue in the backend meanwhile), and a buffer that stays full for the
app's ``stream_stall_s`` cuts the stream (counted in
``mlxpp_http_connections_cut{reason="stream_stalled"}``); the caller then closes the
generations, which frees their sequences. A stream's socket keeps a small kernel buffer, so a
client that stops reading is noticed after kilobytes, not megabytes; a write the client never
reads is cut by the listener's write deadline (``app/http_site.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from aiohttp import web

from mlxppd.http.api_state import DEFAULT_STREAM_SEND_BUFFER_BYTES, STATE
from mlxppd.http.base_app import cut_counter, request_log
from mlxppd.http.completion import ClientGone
from mlxppd.http.errors import ApiError, from_backend_error
from mlxppd.runtime.backends.contract import AdmissionRejected, BackendUnavailable

log = logging.getLogger("mlxppd.http")

Item = TypeVar("Item")

_STALLED_NOTE = "stream cut: the client stopped reading"


class StreamStalled(ClientGone):
    """The client stopped reading: the stream's buffer filled and the stream was cut."""


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
        state = request.app[STATE] if STATE in request.app else None
        _cap_buffers(
            request.transport,
            state.stream_send_buffer_bytes if state else DEFAULT_STREAM_SEND_BUFFER_BYTES,
        )
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
        info.note = info.note or "client closed the stream"  # a cut stream says so already
    except Exception as exc:
        error = from_backend_error(exc)
        if error.status >= 500 and not isinstance(exc, AdmissionRejected | BackendUnavailable):
            log.exception("%s stream failed", info.request_id)
        info.note = f"stream ended by error: {error.message}"
        with contextlib.suppress(ClientGone):
            await send_error(error)


def _cap_buffers(transport: asyncio.BaseTransport | None, send_bytes: int) -> None:
    """A small kernel send buffer and transport buffer for a stream's socket: what a client
    that stops reading makes the server hold (the default kernel buffer grows to megabytes)."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_bytes)
    with contextlib.suppress(AttributeError, NotImplementedError):
        transport.set_write_buffer_limits(high=send_bytes)  # type: ignore[attr-defined]


class Holdback(Protocol):
    """What decides how much of the generated text may go out as content now
    (``tools.ContentHoldback``: text that may begin a tool call waits)."""

    def feed(self, piece: str) -> str: ...


async def send_content(
    request: web.Request,
    pieces: AsyncIterator[Any],
    hold: Holdback | None,
    send: Callable[[str], Awaitable[None]],
) -> None:
    """Send one generation's text as it comes (``send`` per non-empty piece), through a
    bounded ``StreamFeed``, with what ``hold`` holds back (a tool call being written) left
    out. The feed is closed however this ends (a client gone mid-send included)."""
    async with StreamFeed(request, [pieces]) as feed:
        async for _, piece in feed:
            if piece is None:
                return
            text = hold.feed(piece.text) if hold is not None else piece.text
            if text:
                await send(text)


class StreamFeed(Generic[Item]):
    """The sources of one stream (one per choice), each pulled by a task of its own into one
    buffer of the app's ``stream_buffer_events``. A buffer that stays full for the app's
    ``stream_stall_s`` means the client has stopped reading (a slow one catches up within it):
    the stream is cut (its connection aborted, counted, noted in the request's log line) and
    iterating raises ``StreamStalled``. Iterating gives ``(index, item)`` and
    ``(index, None)`` when source ``index`` ends, and raises what a source raised. The caller
    closes what the sources come from once the ``async with`` has stopped the tasks."""

    def __init__(self, request: web.Request, sources: Sequence[AsyncIterator[Item]]) -> None:
        self._request = request
        self._sources = sources
        limit = request.app[STATE].stream_buffer_events
        self._stall_s = request.app[STATE].stream_stall_s
        self._queue: asyncio.Queue[tuple[int, Item | BaseException | None]] = asyncio.Queue(limit)
        self._tasks: list[asyncio.Task[None]] = []
        self.stalled = False

    async def __aenter__(self) -> StreamFeed[Item]:
        self._tasks = [
            asyncio.ensure_future(self._pull(i, source)) for i, source in enumerate(self._sources)
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Item | None]]:
        running = len(self._sources)
        while running:
            if self.stalled:
                raise StreamStalled()
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
            yield index, item

    async def _pull(self, index: int, source: AsyncIterator[Item]) -> None:
        try:
            async for item in source:
                if not await self._offer(index, item):
                    return
            await self._offer(index, None)
        except Exception as exc:
            await self._offer(index, exc)
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _offer(self, index: int, item: Item | BaseException | None) -> bool:
        if self.stalled:
            return False
        try:
            await asyncio.wait_for(self._queue.put((index, item)), self._stall_s)
        except TimeoutError:
            if not self.stalled:
                self._cut()
            return False
        return not self.stalled

    def _cut(self) -> None:
        self.stalled = True
        request_log(self._request).note = _STALLED_NOTE
        if (count := cut_counter(self._request.app)) is not None:
            count("stream_stalled")
        transport = self._request.transport
        if transport is not None:
            transport.abort()  # wakes the writer waiting for the client to read
