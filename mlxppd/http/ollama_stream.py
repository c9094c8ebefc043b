"""What the Ollama API sends for one generation: the reply's JSON object, or its NDJSON lines
(``application/x-ndjson``: one object a line, the last ``"done": true``), with Ollama's
counts and durations measured on this request (``Timing``).

``/api/chat`` puts text in ``message.content`` and calls in ``message.tool_calls`` (the
arguments an object); ``/api/generate`` puts it in ``response``. The durations are
nanoseconds: ``load_duration`` from the request's arrival to the prompt handed to the
pipeline (reading, rendering and tokenizing it; the model itself is always loaded),
``prompt_eval_duration`` from there to the first token (admission and prefill),
``eval_duration`` from the first token to the last, ``total_duration`` the whole.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from mlxppd.http.completion import Generation
from mlxppd.http.errors import OLLAMA_ERRORS, ApiError
from mlxppd.http.partial_calls import closed_json
from mlxppd.http.sse import SseWriter
from mlxppd.http.tools import ToolCall, ToolPlan

NDJSON = "application/x-ndjson"


def created_at() -> str:
    """Now, as Ollama writes it: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class Timing:
    """The moments of one request, from ``time.perf_counter_ns``."""

    arrived: int = field(default_factory=time.perf_counter_ns)
    submitted: int = 0
    first: int = 0

    def submit(self) -> None:
        self.submitted = time.perf_counter_ns()

    def first_token(self) -> None:
        self.first = time.perf_counter_ns()

    def durations(self) -> dict[str, int]:
        end = time.perf_counter_ns()
        submitted = self.submitted or end
        first = self.first or submitted
        return {
            "total_duration": end - self.arrived,
            "load_duration": submitted - self.arrived,
            "prompt_eval_duration": first - submitted,
            "eval_duration": end - first,
        }


def ollama_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls in Ollama's shape: the function's name and its arguments as an object (a call
    the length limit cut: its arguments as far as they went)."""
    return [
        {
            "function": {
                "name": c.name,
                "arguments": closed_json(c.arguments) if c.partial else json.loads(c.arguments),
            }
        }
        for c in calls
    ]


class Reply:
    """The objects of one /api/chat (``chat``) or /api/generate reply."""

    def __init__(self, model: str, chat: bool, tools: ToolPlan | None = None) -> None:
        self.model = model
        self.chat = chat
        self.tools = tools or ToolPlan()

    def _text(self, text: str, calls: list[ToolCall] | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"response": text}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = ollama_calls(calls)
        return {"message": message}

    def line(self, text: str, calls: list[ToolCall] | None = None) -> dict[str, Any]:
        """A line of a stream that is not its last."""
        return {"model": self.model, "created_at": created_at(), **self._text(text, calls),
                "done": False}  # fmt: skip

    def done(
        self, text: str, reason: str, timing: Timing, gen: Generation | None = None,
        calls: list[ToolCall] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The last object: ``text`` (all of it, or "" ending a stream), why it ended, the
        counts and durations (none counted when nothing was generated: ``load``)."""
        body = {**self.line(text, calls), "done": True, "done_reason": reason}
        body.update(timing.durations())
        if gen is not None:
            body.update(prompt_eval_count=gen.prompt_tokens, eval_count=gen.completion_tokens)
        return body

    def split(self, gen: Generation) -> tuple[str, list[ToolCall]]:
        """The generated text as content and tool calls."""
        if not self.tools.active:
            return gen.text, []
        content, calls = self.tools.finish(gen.text, gen.finish_reason == "length")
        return content or "", calls

    def complete(self, gen: Generation, timing: Timing) -> dict[str, Any]:
        text, calls = self.split(gen)
        return self.done(text, gen.finish_reason, timing, gen, calls)


class NdjsonWriter(SseWriter):
    """One JSON object a line, as Ollama streams; a failure after the start is a last line
    ``{"error": ...}``, which Ollama's clients raise."""

    @classmethod
    async def start(cls, request: web.Request, headers: dict[str, str]) -> NdjsonWriter:
        opened = await cls.open(request, {**headers, "Content-Type": NDJSON})
        return cls(opened.response)

    async def line(self, payload: dict[str, Any]) -> None:
        await self._write(json.dumps(payload, separators=(",", ":")).encode() + b"\n")

    async def error(self, error: ApiError) -> None:
        await self.line(OLLAMA_ERRORS.body(error))
        await self.close()
