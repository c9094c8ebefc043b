"""Request bodies of /v1/chat/completions and /v1/completions, parsed and checked.

The JSON is parsed with a depth limit (a 200,000-deep nesting is a 400, not a RecursionError),
then validated by the models in ``requests.py``; every 400 names the field (``param``) the way
OpenAI does, so clients can show which part of the request is wrong. Nothing is tokenized or
generated before this passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from pydantic import ValidationError

from mlxppd.core.protocol.sampling import GrammarSpec
from mlxppd.http.errors import ApiError, invalid
from mlxppd.http.generation import GenerationRequest
from mlxppd.http.requests import (
    ApiModel,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseFormat,
)
from mlxppd.http.tools import ToolChoice, ToolDef, schema_text

#: OpenAI's documented default for the legacy completions endpoint
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

M = TypeVar("M", bound=ApiModel)


@dataclass(frozen=True, kw_only=True)
class ParsedRequest(GenerationRequest):
    """A chat or completions request, checked: what it asks of the model, plus its own."""

    stream: bool
    include_usage: bool
    #: chat: the tools the model may call, and how (None: auto when there are tools)
    tools: tuple[ToolDef, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    #: chat: the messages (role, content as text, tool calls); completions: None
    messages: tuple[dict[str, Any], ...] | None = None
    #: completions: the prompt as text or as token ids; chat: None
    prompt: str | list[int] | None = None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; orjson refuses nesting deeper than 1024 and invalid UTF-8."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_json")
    return body


def param_of(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` -> ``"messages[0].role"``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _code(error_type: str) -> str:
    if error_type == "missing":
        return "missing_required_parameter"
    if error_type in ("unsupported", "invalid_type") or error_type.endswith("_type"):
        return "unsupported" if error_type == "unsupported" else "invalid_type"
    return "invalid_value"


def validate(model: type[M], body: dict[str, Any]) -> M:
    """``body`` as ``model``; the first error becomes a 400 naming its field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        param = param_of(tuple(first["loc"])) or None
        message = first["msg"]
        if first["type"] == "missing":
            message = "is required"
        raise ApiError(
            400, f"{param}: {message}" if param else message, param=param,
            code=_code(first["type"]),
        ) from None  # fmt: skip


def _stream_usage(request: ChatCompletionRequest | CompletionRequest) -> bool:
    if request.stream_options is None:
        return False
    if not request.stream:
        raise invalid(
            "'stream_options' is only allowed when 'stream' is true",
            "stream_options",
            "invalid_value",
        )
    return request.stream_options.include_usage


def _parsed(
    request: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, **rest: Any
) -> ParsedRequest:
    """The fields both endpoints share, plus ``rest`` (each endpoint's own)."""
    return ParsedRequest(
        model=request.model,
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=request.stop,
        stream=request.stream,
        include_usage=_stream_usage(request),
        n=request.n,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=request.logit_bias,
        grammar=_grammar(request.response_format),
        **rest,
    )


def _grammar(response_format: ResponseFormat | None) -> GrammarSpec | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object" or response_format.json_schema is None:
        return GrammarSpec(kind="json_object")
    spec = response_format.json_schema
    # The request model bounded exactly this text (tools.BoundedSchema), so it fits here.
    text = schema_text(spec.schema_)
    return GrammarSpec(kind="json_schema", schema_text=text, strict=spec.strict is not False)


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as the chat template (and ``tools.template_messages``) takes it."""
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump(mode="json") for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    request = validate(ChatCompletionRequest, body)
    if request.top_logprobs and not request.logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs", "invalid_value")
    return _parsed(
        request,
        request.max_completion_tokens or request.max_tokens,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs or 0,
        tools=tuple(request.tools or ()),
        tool_choice=request.tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        messages=tuple(_message(m) for m in request.messages),
    )


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    request = validate(CompletionRequest, body)
    return _parsed(
        request,
        request.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS,
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs or 0,
        prompt=request.prompt,
    )
