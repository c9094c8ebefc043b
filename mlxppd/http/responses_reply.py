"""The Response object of OpenAI's Responses API, built from one generation.

A generation's text becomes the response's output items: a ``message`` with one
``output_text`` part, and a ``function_call`` item per tool call the text makes (split as the
chat API splits it, ``ToolPlan.finish``). A generation cut by its token budget is an
``incomplete`` response whose ``incomplete_details`` says ``max_output_tokens``. The shapes are
``responses_models.py``'s, as the ``openai`` SDK parses them.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from mlxppd.http.completion import Generation
from mlxppd.http.responses_models import ResponsesRequest
from mlxppd.http.tools import ToolCall, ToolPlan

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``resp_``, ``msg_``, ``fc_`` and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def usage(gen: Generation) -> dict[str, Any]:
    return {
        "input_tokens": gen.prompt_tokens,
        # The input tokens the stages took from a kept prefix (the prompt cache).
        "input_tokens_details": {"cached_tokens": gen.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": gen.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
    }


def _text_format(body: ResponsesRequest) -> dict[str, Any]:
    if body.text is None or body.text.format is None:
        return {"format": {"type": "text"}}
    return {"format": body.text.format.model_dump(mode="json", by_alias=True, exclude_none=True)}


class ResponseReply:
    """One response's id, its echo of the request, and its output items."""

    def __init__(self, body: ResponsesRequest, model: str, plan: ToolPlan) -> None:
        self.body = body
        self.model = model
        self.plan = plan
        self.id = new_id("resp")
        self.created_at = int(time.time())

    @staticmethod
    def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "type": "message",
            "id": item_id or new_id("msg"),
            "role": "assistant",
            "status": status,
            "content": [part] if status != "in_progress" else [],
        }

    @staticmethod
    def call_item(call: ToolCall, status: str, item_id: str | None = None) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": item_id or new_id("fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if status != "in_progress" else "",
            "status": status,
        }

    def split(self, gen: Generation) -> tuple[str | None, list[ToolCall]]:
        """The generated text as the message's text and the calls it makes."""
        if not self.plan.active:
            return gen.text, []
        return self.plan.finish(gen.text, gen.finish_reason == "length")

    def status(self, gen: Generation, calls: list[ToolCall]) -> str:
        """incomplete when the length limit ended it: its text, or a call it was writing
        (which comes back as an incomplete function_call item, never as text)."""
        cut = gen.finish_reason == "length"
        return "incomplete" if cut and (not calls or calls[-1].partial) else "completed"

    @staticmethod
    def call_status(call: ToolCall) -> str:
        return "incomplete" if call.partial else "completed"

    def output(self, gen: Generation) -> tuple[str, list[dict[str, Any]]]:
        """A finished generation's status and output items."""
        text, calls = self.split(gen)  # once: each split gives its calls new ids
        status = self.status(gen, calls)
        items = [self.message_item(text or "", status)] if text or not calls else []
        return status, items + [self.call_item(call, self.call_status(call)) for call in calls]

    def response(
        self, status: str, output: list[dict[str, Any]], gen: Generation | None
    ) -> dict[str, Any]:
        """The Response object: ``gen`` None while it is being generated (no usage yet)."""
        body = self.body
        choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage(gen) if gen is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "error": None,
            "instructions": body.instructions,
            "metadata": dict(body.metadata or {}),
            "temperature": DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            "top_p": DEFAULT_TOP_P if body.top_p is None else body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": choice.model_dump(mode="json")
            if choice is not None and not isinstance(choice, str)
            else (choice or "auto"),
            "tools": [t.model_dump(mode="json") for t in body.tools or ()],
            "text": _text_format(body),
            "store": body.store is not False,
            "truncation": body.truncation or "disabled",
            "background": False,
        }

    def complete(self, gen: Generation) -> dict[str, Any]:
        """The Response object of a finished generation."""
        status, output = self.output(gen)
        return self.response(status, output, gen)
