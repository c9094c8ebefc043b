"""A chat request's prompt: the model's chat template over the messages, with the tools.

A template that renders ``tools`` itself gets them as they are; one that ignores them (it
renders the same text with and without) gets them described in a system message
(``tools.template_messages``). A forced call (``tool_choice`` required or named) ends the
prompt with the call's opening marker. A ``developer`` message is a system message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxppd.http.prompt_bound import bounded_tokens
from mlxppd.http.tools import TOOL_CALL_START, ToolDef, ToolPlan, template_messages

_PROBE = [{"role": "user", "content": "x"}]
#: per tokenizer object: whether its template renders ``tools`` (asked once)
_NATIVE: dict[int, bool] = {}


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer has a chat template to render a conversation with."""
    return bool(getattr(tokenizer, "has_chat_template", None) or tokenizer.chat_template)


def renders_tools(tokenizer: Any, tools: Sequence[ToolDef]) -> bool:
    key = id(tokenizer)
    if key not in _NATIVE:
        listing = [t.model_dump(mode="json") for t in tools]
        try:
            bare = tokenizer.apply_chat_template(_PROBE, tokenize=False)
            with_tools = tokenizer.apply_chat_template(_PROBE, tools=listing, tokenize=False)
            _NATIVE[key] = bare != with_tools
        except Exception:  # a template that fails on the tools argument does not render them
            _NATIVE[key] = False
    return _NATIVE[key]


def system_roles(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's ``developer`` role is the system role (newer clients send it instead): the
    templates know only ``system``, and would otherwise render a literal developer turn after
    their default system prompt."""
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def chat_prompt(
    tokenizer: Any, messages: Sequence[dict[str, Any]], plan: ToolPlan, context: int
) -> list[int]:
    """The prompt's token ids (the template may raise on a conversation it refuses); a 400
    before tokenizing when its text is too long for ``context`` tokens (``prompt_bound.py``)."""
    native = plan.active and renders_tools(tokenizer, plan.tools)
    conversation = template_messages(system_roles(messages), plan.tools, native)
    extra: dict[str, Any] = {}
    if native:
        extra["tools"] = [t.model_dump(mode="json") for t in plan.tools]
    # Rendered, then tokenized as the template's own tokenize=True does (no special tokens
    # added), with the length checked in between.
    text = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False, **extra
    )
    ids = bounded_tokens(tokenizer, text, context, "messages", add_special_tokens=False)
    if plan.forced:
        ids += [int(t) for t in tokenizer.encode(TOOL_CALL_START + "\n", add_special_tokens=False)]
    return ids
