"""Tools (function calling) for the chat API: the tool definitions and choices a request may
carry, how they reach the chat template, and how the model's calls come back as ``tool_calls``.

Calls use the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` form (the Hermes /
Qwen convention mlx-lm's ``json_tools`` parser reads). A chat template that renders ``tools``
itself gets them as they are; for one that ignores them (the template renders the same text with
and without), the tools and the call form are described in a system message, assistant calls
are written back in the call form and tool results as ``<tool_response>`` user turns. With
``tool_choice`` ``required`` or a named function, the prompt ends with the opening marker and
the sampler is constrained to a JSON object matching the function's schema
(``engine/grammar.py``), so even a small model returns a valid call.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from mlxppd.core.protocol.sampling import MAX_SCHEMA_BYTES
from mlxppd.http.partial_calls import partial_call

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
MAX_TOOLS = 128


def schema_text(schema: dict[str, Any]) -> str:
    """``schema`` as the text the last stage compiles: compact, ASCII JSON, which the stage
    writes the same way again (``engine/grammar.py``), so the bound is measured on exactly
    what is used. ValueError, naming the limit, past MAX_SCHEMA_BYTES or when it is not JSON."""
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        raise ValueError("a schema must be plain JSON nested at most a few hundred deep") from None
    if len(text) > MAX_SCHEMA_BYTES:  # ASCII: its characters are its bytes
        raise ValueError(
            f"a schema is at most {MAX_SCHEMA_BYTES} bytes as compact JSON with non-ASCII "
            f"characters escaped; this one is {len(text)}"
        )
    return text


def _bounded_schema(value: dict[str, Any]) -> dict[str, Any]:
    try:
        schema_text(value)
    except ValueError as exc:
        raise PydanticCustomError("invalid_value", "{why}", {"why": str(exc)}) from None
    return value


#: a JSON schema a client sends (a tool's parameters, a response format): at most
#: MAX_SCHEMA_BYTES as ``schema_text`` writes it, as the stage's grammar compiler takes it
BoundedSchema = Annotated[dict[str, Any], AfterValidator(_bounded_schema)]

FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class _Api(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class FunctionDef(_Api):
    name: FunctionName
    description: str = Field("", max_length=8192)
    parameters: BoundedSchema = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="a JSON schema of the arguments",
    )
    strict: bool | None = None


class ToolDef(_Api):
    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(_Api):
    name: FunctionName


class NamedToolChoice(_Api):
    type: Literal["function"]
    function: _NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CallFunction(_Api):
    name: FunctionName
    arguments: str = Field(max_length=1 << 20, description="the arguments as a JSON string")


class ToolCallIn(_Api):
    """A call the assistant made, as a client sends it back in the conversation."""

    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: CallFunction


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text (a cut call's: as far as it was generated)"""
    partial: bool = False
    """the length limit cut it off (``http/partial_calls.py``)"""

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def forced_function(
    tools: Sequence[ToolDef], choice: ToolChoice | None
) -> tuple[ToolDef, ...] | None:
    """The functions decoding is constrained to (``required``: any; named: that one); None
    when the model chooses freely. A named function missing from ``tools`` is a ValueError."""
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return tuple(named)
    if choice == "required":
        if not tools:
            raise ValueError("tool_choice 'required' needs at least one tool")
        return tuple(tools)
    return None


def call_schema(functions: Sequence[ToolDef]) -> dict[str, Any]:
    """The JSON schema of one call to one of ``functions``."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tools_system_text(tools: Sequence[ToolDef]) -> str:
    """The system text that describes the tools to a template that does not render them."""
    listing = json.dumps([t.model_dump(mode="json") for t in tools], ensure_ascii=False)
    return (
        "You can call the functions described below. To call one, answer with a block\n"
        f'{TOOL_CALL_START}\n{{"name": <function name>, "arguments": <arguments object>}}\n'
        f"{TOOL_CALL_END}\n(one block per call) and nothing else. Functions:\n{listing}"
    )


def template_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[ToolDef], native: bool
) -> list[dict[str, Any]]:
    """The conversation for the chat template. ``native``: the template renders tools, tool
    calls and tool results itself; otherwise they are written in the call form."""
    if native:
        return [dict(m) for m in messages]
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [
                f'{TOOL_CALL_START}\n{{"name": {json.dumps(c["function"]["name"])}, '
                f'"arguments": {c["function"]["arguments"]}}}\n{TOOL_CALL_END}'
                for c in message["tool_calls"]
            ]
            text = "\n".join(filter(None, [content, *blocks]))
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        system = tools_system_text(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def parse_calls(text: str, tools: Sequence[ToolDef]) -> tuple[str | None, list[ToolCall]]:
    """Split generated text into its content and the calls it makes; a block that is not a
    call to a known function with a JSON object of arguments stays text."""
    names = {t.function.name for t in tools}
    calls: list[ToolCall] = []
    content: list[str] = []
    rest = text
    while (start := rest.find(TOOL_CALL_START)) >= 0:
        end = rest.find(TOOL_CALL_END, start)
        body = rest[start + len(TOOL_CALL_START) : end if end >= 0 else len(rest)]
        call = _call_of(body, names)
        if call is None:
            content.append(rest[: (end + len(TOOL_CALL_END)) if end >= 0 else len(rest)])
        else:
            content.append(rest[:start])
            calls.append(call)
        rest = rest[end + len(TOOL_CALL_END) :] if end >= 0 else ""
    content.append(rest)
    joined = "".join(content).strip()
    return (joined or None), calls


def _call_of(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), str(value["name"]), json.dumps(arguments, ensure_ascii=False))


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools."""

    tools: tuple[ToolDef, ...] = ()
    """the tools the model may call (none when there are none or tool_choice is none)"""
    forced: tuple[ToolDef, ...] | None = None
    """required / named: decoding is constrained to one call of these"""

    @property
    def active(self) -> bool:
        return bool(self.tools)

    def call_grammar(self) -> dict[str, Any] | None:
        """The JSON schema decoding is held to, for a forced call."""
        return call_schema(self.forced) if self.forced else None

    def holdback(self) -> ContentHoldback | None:
        """Streaming: what holds back text that may begin a call (None without tools)."""
        return ContentHoldback(bool(self.forced)) if self.active else None

    def finish(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """The generated text as content and calls (a forced call's text is its JSON).
        ``cut``: the length limit ended it; a call it was writing comes back partial (marked
        ``partial``), never as text."""
        if self.forced:
            text = TOOL_CALL_START + text + ("" if cut else TOOL_CALL_END)
        start = text.rfind(TOOL_CALL_START)
        if not cut or start < 0 or text.find(TOOL_CALL_END, start) >= 0:
            return parse_calls(text, self.tools)
        content, calls = parse_calls(text[:start], self.tools)
        found = partial_call(text[start + len(TOOL_CALL_START) :], self._names())
        if found is not None:
            calls.append(ToolCall(new_call_id(), found[0], found[1], partial=True))
        return content, calls

    def _names(self) -> list[str]:
        return [t.function.name for t in self.forced or self.tools]


def plan_tools(tools: Sequence[ToolDef], choice: ToolChoice | None) -> ToolPlan:
    """ValueError when ``choice`` names a missing function or requires a call without tools."""
    if choice == "none" or not tools:
        if isinstance(choice, NamedToolChoice) or choice == "required":
            forced_function(tools, choice)  # raises: there is nothing to call
        return ToolPlan()
    return ToolPlan(tuple(tools), forced_function(tools, choice))


class ContentHoldback:
    """Streaming with tools: text goes out until a call may be starting; from the first
    ``<tool_call>`` on, nothing more is content (the calls go out at the end)."""

    def __init__(self, forced: bool = False) -> None:
        """``forced``: the whole output is the call (its marker ended the prompt)."""
        self.text = ""
        self.sent = 0
        self.calling = forced

    def feed(self, piece: str) -> str:
        """What of ``piece`` can be sent as content now."""
        self.text += piece
        if self.calling:
            return ""
        marker = self.text.find(TOOL_CALL_START, max(0, self.sent - len(TOOL_CALL_START)))
        if marker >= 0:
            self.calling = True
            out, self.sent = self.text[self.sent : marker], marker
            return out
        keep = _partial_marker(self.text)
        end = max(self.sent, len(self.text) - keep)
        out, self.sent = self.text[self.sent : end], end
        return out


def _partial_marker(text: str) -> int:
    """Length of the longest end of ``text`` that begins the call marker."""
    for n in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0
