"""Server-sent events the way OpenAI streams: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from mlxppd.http.completion import ClientGone


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
