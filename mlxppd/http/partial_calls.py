"""A tool call the length limit cut off: what of it was generated, as a call.

OpenAI returns such a call in ``tool_calls`` with its arguments as far as they go and
``finish_reason: "length"``; Anthropic as a ``tool_use`` block with ``stop_reason:
"max_tokens"``. Here the model writes a call as ``{"name": ..., "arguments": {...}}`` after the
call marker (``http/tools.py``); cut, that JSON is unterminated."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

#: the call's name, once the model has written it whole
_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
#: where the arguments begin
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def partial_call(body: str, names: Sequence[str]) -> tuple[str, str] | None:
    """(name, arguments text so far) of a cut call's ``body``; the name is the one function
    it can be when the model had not finished writing it. None: no function fits."""
    found = _NAME.match(body)
    if found is not None:
        name = json.loads(f'"{found.group(1)}"')
        if name not in names:
            return None
    else:
        typed = re.match(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)$', body)
        prefix = typed.group(1) if typed is not None else ""
        fits = [n for n in names if n.startswith(prefix)]
        if len(fits) != 1:
            return None
        name = fits[0]
    arguments = _ARGUMENTS.search(body)
    return name, body[arguments.end() :].rstrip() if arguments is not None else ""


def closed_json(prefix: str) -> dict[str, Any]:
    """The object a cut JSON text was becoming, as far as it went: open strings, arrays and
    objects closed, a dangling key or separator dropped; {} when nothing parses."""
    stack: list[str] = []
    in_string = escaped = False
    for char in prefix:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            stack.append("]" if char == "[" else "}")
        elif char in "]}" and stack:
            stack.pop()
    text = prefix
    if escaped:
        text = text[:-1]
    if in_string:
        text += '"'
    # Cut at most a few tokens back (a dangling key, colon, comma or a number's part) before
    # giving up: each try is one parse of the whole text.
    for _ in range(8):
        value = _loads("".join([text, *reversed(stack)]))
        if isinstance(value, dict):
            return value
        text = re.sub(r'(,?\s*"(?:[^"\\]|\\.)*"\s*:?\s*|,\s*|:\s*|[^,:\[\]{}"]+)$', "", text)
    return {}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
