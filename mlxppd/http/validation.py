"""Request bodies of /v1/chat/completions and /v1/completions, checked field by field.

Everything is validated before any tokenizing or generation, and each 400 names the field
(``param``) the way OpenAI does, so clients can show which part of the request is wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from mlxppd.http.errors import invalid

MAX_STOP_STRINGS = 4
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: OpenAI's documented default for the legacy completions endpoint
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class ParsedRequest:
    """The fields both endpoints share, already checked."""

    model: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    #: chat: the messages (role, content as text); completions: None
    messages: tuple[dict[str, str], ...] | None = None
    #: completions: the prompt as text or as token ids; chat: None
    prompt: str | list[int] | None = None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_json")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _optional_int(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise invalid(f"'{name}' must be an integer, got {value!r}", name, "invalid_type")
    if minimum is not None and value < minimum:
        raise invalid(f"'{name}' must be at least {minimum}, got {value}", name, "invalid_value")
    return int(value)


def _optional_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean, got {value!r}", name, "invalid_type")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise invalid(f"'{name}' must be a number, got {value!r}", name, "invalid_type")
    return float(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid(
            f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}",
            "stop",
            "invalid_value",
        )
    # An empty stop string would match at once; OpenAI ignores it, so do we.
    return tuple(s for s in items if s)


def _common(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", "model", "invalid_type")
    n = _optional_int(body, "n")
    if n is not None and n != 1:
        raise invalid("only n=1 is supported", "n", "invalid_value")
    best_of = _optional_int(body, "best_of")
    if best_of is not None and best_of != 1:
        raise invalid("only best_of=1 is supported", "best_of", "invalid_value")
    max_tokens = _optional_int(body, "max_tokens", minimum=1)
    if chat:
        max_completion = _optional_int(body, "max_completion_tokens", minimum=1)
        if max_completion is not None:
            max_tokens = max_completion
    # OpenAI samples at temperature 1 unless told otherwise; greedy needs temperature 0.
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise invalid(
            f"'temperature' must be between 0 and 2, got {temperature}",
            "temperature",
            "invalid_value",
        )
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise invalid(f"'top_p' must be in (0, 1], got {top_p}", "top_p", "invalid_value")
    seed = _optional_int(body, "seed")
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid(
                "'stream_options' is only allowed when 'stream' is true",
                "stream_options",
                "invalid_value",
            )
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object", "stream_options", "invalid_type")
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise invalid(
                "'stream_options.include_usage' must be a boolean",
                "stream_options.include_usage",
                "invalid_type",
            )
        include_usage = bool(usage)
    for unsupported in ("tools", "functions"):
        if body.get(unsupported):
            raise invalid(
                f"'{unsupported}' is not supported by this server", unsupported, "unsupported"
            )
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "stop": _stop(body),
        "stream": stream,
        "include_usage": include_usage,
    }


def _message_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(
                    "only text content parts are supported", f"{param}[{j}]", "unsupported"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid("a text part needs a string 'text'", f"{param}[{j}].text", None)
            parts.append(text)
        return "".join(parts)
    raise invalid("'content' must be a string or a list of text parts", param, "invalid_type")


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    common = _common(body, chat=True)
    messages = body.get("messages")
    if messages is None:
        raise invalid("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages", "invalid_value")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid("each message must be an object", f"messages[{i}]", "invalid_type")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(
                f"unknown role {role!r}; expected one of {', '.join(sorted(CHAT_ROLES))}",
                f"messages[{i}].role",
                "invalid_value",
            )
        content = message.get("content")
        if content is None:
            raise invalid(
                "'content' is required", f"messages[{i}].content", "missing_required_parameter"
            )
        checked.append({"role": role, "content": _message_text(content, f"messages[{i}].content")})
    logprobs = _optional_bool(body, "logprobs")
    top = _optional_int(body, "top_logprobs", minimum=0)
    if top is not None and top > 20:
        raise invalid("'top_logprobs' must be at most 20", "top_logprobs", "invalid_value")
    return ParsedRequest(**common, logprobs=logprobs, messages=tuple(checked))


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    common = _common(body, chat=False)
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt is one prompt
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
            raise invalid(
                "'prompt' must be a string or one list of token ids (batches are not supported)",
                "prompt",
                "invalid_value",
            )
    elif not isinstance(prompt, str):
        raise invalid("'prompt' must be a string", "prompt", "invalid_type")
    logprobs_n = _optional_int(body, "logprobs", minimum=0)
    if logprobs_n is not None and logprobs_n > 5:
        raise invalid("'logprobs' must be at most 5", "logprobs", "invalid_value")
    if _optional_bool(body, "echo"):
        raise invalid("'echo' is not supported", "echo", "unsupported")
    if body.get("suffix"):
        raise invalid("'suffix' is not supported", "suffix", "unsupported")
    if common["max_tokens"] is None:
        common["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    return ParsedRequest(**common, logprobs=logprobs_n is not None, prompt=prompt)
