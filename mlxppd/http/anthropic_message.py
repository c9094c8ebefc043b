"""What the Anthropic Messages API sends: the message object and its stream events for one
request (``MessageReply``), why a message stopped, and errors in Anthropic's shape
(``ANTHROPIC_ERRORS``, which the base app renders every error under /v1/messages in).

The bodies are those of ``http/anthropic_models.py``'s response models.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from mlxppd.http.anthropic_models import OVERLOADED_STATUS
from mlxppd.http.anthropic_tools import reply_blocks
from mlxppd.http.completion import Generation
from mlxppd.http.errors import ApiError, ErrorShape
from mlxppd.http.tools import ToolPlan

#: Anthropic's error type per status; another status is an api_error (5xx) or an invalid request
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED_STATUS: "overloaded_error",
}


class AnthropicErrors:
    """Anthropic's ``{"type": "error", "error": {"type", "message"}, "request_id"}``; a 503 is
    Anthropic's 529 overloaded. Its error has no ``param``: the message starts with the field
    at fault instead."""

    @staticmethod
    def status(error: ApiError) -> int:
        return OVERLOADED_STATUS if error.status == 503 else error.status

    def body(self, error: ApiError, request_id: str | None = None) -> dict[str, Any]:
        message, param = error.message, error.param
        if param and not message.startswith(f"{param}:"):
            message = f"{param}: {message}"
        status = self.status(error)
        kind = ERROR_TYPES.get(status) or (
            "api_error" if status >= 500 else "invalid_request_error"
        )
        body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
        if request_id:
            body["request_id"] = request_id
        return body

    def response(self, error: ApiError, request_id: str | None = None) -> web.Response:
        headers = dict(error.headers)
        if request_id:  # Anthropic's clients read request-id; the log's X-Request-Id stays
            headers.update({"X-Request-Id": request_id, "request-id": request_id})
        body = self.body(error, request_id)
        return web.json_response(body, status=self.status(error), headers=headers)


ANTHROPIC_ERRORS: ErrorShape = AnthropicErrors()


def stop_reason(gen: Generation) -> str:
    """Why a generation ended, as Anthropic says it (a stop sequence apart from the model's own
    end of turn); tool calls are the reply's to tell."""
    if gen.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if gen.finish_reason == "length" else "end_turn"


class MessageReply:
    """Anthropic's message object and stream events for one request."""

    def __init__(self, model: str, tools: ToolPlan) -> None:
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self.tools = tools

    def _object(self, content: list[dict[str, Any]], gen: Generation | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(gen) if gen else None,
            "stop_sequence": gen.stop_string if gen else None,
        }

    def blocks(self, gen: Generation) -> tuple[list[dict[str, Any]], bool]:
        """The reply's content blocks, and whether it calls tools."""
        if not self.tools.active:
            return [{"type": "text", "text": gen.text}], False
        content, calls = self.tools.finish(gen.text, gen.finish_reason == "length")
        # A call cut by max_tokens is a tool_use block (its input as far as it went), but
        # the reply says max_tokens: the client must not run it as if whole.
        return reply_blocks(content, calls), any(not c.partial for c in calls)

    def complete(self, gen: Generation) -> dict[str, Any]:
        blocks, calls = self.blocks(gen)
        body = self._object(blocks, gen)
        if calls:
            body.update(stop_reason="tool_use", stop_sequence=None)
        usage = {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens}
        return {**body, "usage": usage}

    def opening(self, gen: Generation) -> list[dict[str, Any]]:
        """A stream's first events: the message, its text block's start, a ping."""
        usage = {"input_tokens": gen.prompt_tokens, "output_tokens": 0}
        block = {"type": "text", "text": ""}
        return [
            {"type": "message_start", "message": {**self._object([], None), "usage": usage}},
            {"type": "content_block_start", "index": 0, "content_block": block},
            {"type": "ping"},
        ]

    @staticmethod
    def text_delta(text: str) -> dict[str, Any]:
        delta = {"type": "text_delta", "text": text}
        return {"type": "content_block_delta", "index": 0, "delta": delta}

    def closing(self, gen: Generation) -> Iterator[dict[str, Any]]:
        """A stream's last events, once its text is out: the text block's end, a block per tool
        call (its input as one JSON delta), why it stopped, the message's end. Made as they
        are sent: a failure here ends the stream after what went out before it."""
        yield {"type": "content_block_stop", "index": 0}
        blocks, calls = self.blocks(gen)
        for index, tool_use in enumerate((b for b in blocks if b["type"] == "tool_use"), 1):
            start = {**tool_use, "input": {}}
            yield {"type": "content_block_start", "index": index, "content_block": start}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_use["input"])}
            yield {"type": "content_block_delta", "index": index, "delta": delta}
            yield {"type": "content_block_stop", "index": index}
        reason, sequence = ("tool_use", None) if calls else (stop_reason(gen), gen.stop_string)
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": gen.completion_tokens},
        }
        yield {"type": "message_stop"}
