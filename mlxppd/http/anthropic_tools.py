"""Tools in the Anthropic Messages API, over the chat API's tools (``http/tools.py``).

Anthropic's tool definitions are functions with an ``input_schema``; ``tool_choice`` ``auto``,
``any`` (a call is required), ``tool`` (that one) and ``none`` map to the chat API's choices. An
assistant's ``tool_use`` blocks become its tool calls, a user's ``tool_result`` blocks the tool
messages that answer them, and the reply's calls come back as ``tool_use`` blocks with
``stop_reason: "tool_use"``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

from mlxppd.http.partial_calls import closed_json
from mlxppd.http.tools import (
    FunctionDef,
    NamedToolChoice,
    ToolCall,
    ToolChoice,
    ToolDef,
    ToolPlan,
    plan_tools,
)


def tool_plan(tools: Sequence[Any] | None, choice: Any) -> ToolPlan:
    """The plan of a request's ``tools`` (ToolDefinition) and ``tool_choice``; ValueError when
    the choice names a missing tool or requires one without tools."""
    defs = [
        ToolDef(
            type="function",
            function=FunctionDef(
                name=t.name, description=t.description or "", parameters=t.input_schema
            ),
        )
        for t in tools or ()
    ]
    chosen: ToolChoice | None = None
    if choice is not None:
        if choice.type == "tool":
            chosen = NamedToolChoice.model_validate(
                {"type": "function", "function": {"name": choice.name}}
            )
        else:
            chosen = {"auto": "auto", "any": "required", "none": "none"}[choice.type]  # type: ignore[assignment]
    return plan_tools(defs, chosen)


def chat_messages(role: str, blocks: Sequence[Any], separator: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: its text, plus an assistant's tool calls, or
    the tool messages of a user's tool results (before the user's own text)."""
    text = separator.join(b.text or "" for b in blocks if b.type == "text")
    if role == "assistant":
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input or {})},
            }
            for b in blocks
            if b.type == "tool_use"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return [message]
    out: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.content or ""}
        for b in blocks
        if b.type == "tool_result"
    ]
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def reply_blocks(content: str | None, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """The reply's content blocks: its text (if any), then one ``tool_use`` per call."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    blocks += [
        {
            "type": "tool_use",
            "id": "toolu_" + secrets.token_hex(12),
            "name": c.name,
            "input": closed_json(c.arguments) if c.partial else json.loads(c.arguments),
        }  # fmt: skip
        for c in calls
    ]
    return blocks
