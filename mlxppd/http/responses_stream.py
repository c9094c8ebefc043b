"""A streamed response (``stream: true``): the Responses API's typed server-sent events, each
``event: <type>`` then its data, numbered by ``sequence_number``.

``response.created`` and ``response.in_progress`` open it; the message's text goes out as
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
per piece, then the ``.done`` events; each tool call as its item, one
``response.function_call_arguments.delta`` and ``.done``; ``response.completed`` (or
``response.incomplete``) carries the whole response last. The generation is pulled through
``sse.StreamFeed``, so a client that stops reading is cut as the chat stream's is; a failure
after the headers is an ``error`` event.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from mlxppd.http.base_app import request_log
from mlxppd.http.completion import Generation
from mlxppd.http.errors import ApiError
from mlxppd.http.responses_reply import ResponseReply, new_id
from mlxppd.http.sse import SseWriter, failures_end_stream, send_content
from mlxppd.http.tools import ToolCall


class _Events:
    """Named events with the stream's running sequence number."""

    def __init__(self, sse: SseWriter) -> None:
        self.sse = sse
        self.number = 0

    async def send(self, kind: str, **fields: Any) -> None:
        await self.sse.named(kind, {"type": kind, "sequence_number": self.number, **fields})
        self.number += 1


class _MessageOut:
    """The message item while its text streams: opened at its first text."""

    def __init__(self, events: _Events, index: int) -> None:
        self.events = events
        self.index = index
        self.id = new_id("msg")
        self.text = ""
        self.opened = False

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}

    async def open(self) -> None:
        self.opened = True
        item = ResponseReply.message_item("", "in_progress", self.id)
        await self.events.send("response.output_item.added", output_index=self.index, item=item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        await self.events.send("response.content_part.added", **self._where(), part=part)

    async def delta(self, text: str) -> None:
        if not self.opened:
            await self.open()
        self.text += text
        await self.events.send(
            "response.output_text.delta", **self._where(), delta=text, logprobs=[]
        )

    async def close(self, status: str) -> dict[str, Any]:
        if not self.opened:
            await self.open()
        where = self._where()
        await self.events.send("response.output_text.done", **where, text=self.text, logprobs=[])
        item = ResponseReply.message_item(self.text, status, self.id)
        part = item["content"][0]
        await self.events.send("response.content_part.done", **where, part=part)
        await self.events.send("response.output_item.done", output_index=self.index, item=item)
        return item


async def _send_call(events: _Events, index: int, call: ToolCall) -> dict[str, Any]:
    item_id = new_id("fc")
    opening = ResponseReply.call_item(call, "in_progress", item_id)
    await events.send("response.output_item.added", output_index=index, item=opening)
    where = {"item_id": item_id, "output_index": index}
    await events.send("response.function_call_arguments.delta", **where, delta=call.arguments)
    await events.send(
        "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
    )
    item = ResponseReply.call_item(call, ResponseReply.call_status(call), item_id)
    await events.send("response.output_item.done", output_index=index, item=item)
    return item


async def stream_response(
    request: web.Request,
    gen: Generation,
    reply: ResponseReply,
    keep: Callable[[dict[str, Any]], None],
) -> web.StreamResponse:
    """Stream ``gen`` (started) as ``reply``'s events; ``keep`` gets the finished response."""
    request_id = request_log(request).request_id
    sse = await SseWriter.open(request, {"X-Request-Id": request_id})
    events = _Events(sse)

    async def send_error(error: ApiError) -> None:
        body = error.body()["error"]
        await events.send("error", code=body["code"], message=body["message"], param=body["param"])
        await sse.close()

    async with failures_end_stream(request, send_error):
        opening = reply.response("in_progress", [], None)
        await events.send("response.created", response=opening)
        await events.send("response.in_progress", response=opening)
        # With tools, text that may begin a call is held back; the calls go out at the end.
        hold = reply.plan.holdback()
        message = _MessageOut(events, 0)
        await send_content(request, gen.pieces(), hold, message.delta)
        _, calls = reply.split(gen)
        status = reply.status(gen, calls)
        output = []
        if message.opened or not calls:
            output.append(await message.close(status))
        for call in calls:
            output.append(await _send_call(events, len(output), call))
        final = reply.response(status, output, gen)
        keep(final)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        await events.send(kind, response=final)
        await sse.close()
    return sse.response
