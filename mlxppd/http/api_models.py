"""Every response body the OpenAI API sends, as pydantic models (the requests are in requests.py).

These describe exactly what ``responses.Shape`` and ``openai_api`` build: the same fields, the
same nullability (a key that is always sent with ``null`` is required and nullable; a key that
is sometimes left out is optional), nothing else (``extra="forbid"``, so a field added to the
server without being added here fails the tests). ``openapi.py`` builds the OpenAPI document
from them; ``tests/http/test_openapi.py`` validates real responses of a live server against them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

#: "stop": EOS or a stop string; "length": max_tokens ran out
FinishReason = Literal["stop", "length"]
#: chat also has "tool_calls": the choice ends with tool calls
ChatFinishReason = Literal["stop", "length", "tool_calls"]
Byte = Annotated[int, Field(ge=0, le=255)]


def _no_default(schema: dict[str, Any]) -> None:
    """For keys that are left out rather than sent as null: no ``"default": null`` to mislead."""
    schema.pop("default", None)


def omitted(description: str) -> Any:
    """A key that is either absent or holds a value of its type (never ``null``); its type is
    spelled ``X | Absent`` so that the schema shows ``X`` alone."""
    return Field(None, description=description, json_schema_extra=_no_default)


#: ``X | Absent``: the key may be left out (the model holds None then) but is never null
Absent = SkipJsonSchema[None]


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- shared ---


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = Field(
        ge=0, description="prompt tokens the stages took from a kept prefix (the prompt cache)"
    )


class Usage(ResponseModel):
    """Token counts: the prompt once (its prefill is shared by the choices), every choice's
    completion tokens (an EOS token counts: it was generated)."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0, description="prompt_tokens + completion_tokens")
    prompt_tokens_details: PromptTokensDetails


class _Head(ResponseModel):
    id: str = Field(description='"chatcmpl-..." for chat, "cmpl-..." for completions')
    created: int = Field(ge=0, description="Unix time (seconds) the request was received")
    model: str = Field(description="the model name clients see (the alias)")
    system_fingerprint: None = Field(description="always null")


# --- chat ---


class TopLogprob(ResponseModel):
    """One of the most likely tokens at a position."""

    token: str = Field(description="the token decoded on its own (U+FFFD for a partial character)")
    logprob: float
    bytes: list[Byte] = Field(description="the UTF-8 bytes of token")


class ChatTokenLogprob(ResponseModel):
    token: str = Field(description="the token decoded on its own (U+FFFD for a partial character)")
    logprob: float | None = Field(description="null only if the pipeline returned none")
    bytes: list[Byte] = Field(description="the UTF-8 bytes of token")
    top_logprobs: list[TopLogprob] = Field(
        description="the top_logprobs most likely tokens, most likely first (empty for 0)"
    )


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob]
    refusal: None = Field(description="always null")


class ToolCallFunction(ResponseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON object's text")


class ToolCall(ResponseModel):
    id: str = Field(description='"call_..."')
    type: Literal["function"]
    function: ToolCallFunction


class ToolCallDelta(ToolCall):
    """A streamed tool call: whole, in the chunk before its choice's last one."""

    index: int = Field(ge=0, description="the call's place among the choice's calls")


class ChatMessageOut(ResponseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when a request with tools got only calls")
    tool_calls: list[ToolCall] | Absent = omitted("only when the model called tools")
    refusal: None = Field(description="always null")


class ChatChoice(ResponseModel):
    index: int = Field(ge=0)
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = Field(description="null unless logprobs was true")
    finish_reason: ChatFinishReason


class ChatCompletion(_Head):
    """The body of a non-streaming chat completion."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice] = Field(min_length=1, description="one per n, by index")
    usage: Usage


class ChatDelta(ResponseModel):
    """What a chunk adds to its choice's message: the first chunk of each choice has
    role "assistant" and content "", the last one (with finish_reason) is empty."""

    role: Literal["assistant"] | Absent = omitted("only in each choice's first chunk")
    content: str | Absent = omitted("absent in the tool-call chunk and each choice's last one")
    tool_calls: list[ToolCallDelta] | Absent = omitted(
        "with tools: the choice's calls, whole, in one chunk before its last"
    )


class ChatChunkChoice(ResponseModel):
    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: ChatLogprobs | None = Field(description="the logprobs of this chunk's tokens")
    finish_reason: ChatFinishReason | None = Field(description="set in each choice's last chunk")


class ChatCompletionChunk(_Head):
    """One server-sent event of a streaming chat completion. Each chunk carries one choice;
    with stream_options.include_usage every chunk has usage null but a last one with no
    choices and the usage."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice] = Field(max_length=1)
    usage: Usage | None = Field(
        None,
        description="only with stream_options.include_usage: null, but in the last chunk",
    )


# --- legacy completions ---


class CompletionLogprobs(ResponseModel):
    """Per generated token, position by position."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] = Field(
        description="per position, the logprobs most likely tokens as {text: logprob}"
    )
    text_offset: list[int] = Field(description="where each token's text starts in text")


class CompletionChoice(ResponseModel):
    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None = Field(description="null unless logprobs was given")
    finish_reason: FinishReason


class TextCompletion(_Head):
    """The body of a non-streaming completion."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice] = Field(min_length=1, description="one per n, by index")
    usage: Usage


class CompletionChunkChoice(ResponseModel):
    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None = Field(description="set in each choice's last chunk")


class TextCompletionChunk(_Head):
    """One server-sent event of a streaming completion (its object is "text_completion", as
    OpenAI's); the usage as in ChatCompletionChunk."""

    object: Literal["text_completion"]
    choices: list[CompletionChunkChoice] = Field(max_length=1)
    usage: Usage | None = Field(
        None,
        description="only with stream_options.include_usage: null, but in the last chunk",
    )


# --- models, health, errors ---


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"]
    created: int = Field(ge=0)
    owned_by: str
    parent: str | Absent = omitted("for a LoRA adapter: the base model it runs on")


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(ResponseModel):
    """200 with status "ok" when every stage is connected and warm, else 503 "unavailable".
    model, detail and stages only for a caller with the API key (or when none is set)."""

    status: Literal["ok", "unavailable"]
    model: str | Absent = omitted("the model name clients see")
    detail: str | Absent = omitted('what the backend says, e.g. "recovering: ..."')
    stages: list[dict[str, Any]] | Absent = omitted("each stage's state (KV use, sequences)")


class ErrorDetail(ResponseModel):
    message: str
    type: str = Field(
        description="invalid_request_error, server_error, server_overloaded, service_unavailable"
    )
    param: str | None = Field(description='the request field at fault, e.g. "messages[2].role"')
    code: str | None = Field(description="e.g. invalid_value, context_length_exceeded")
    # KV admission (503 kv_admission_rejected, or 400 context_length_exceeded when it can
    # never fit): the stage's accounting at that moment.
    stage: int | Absent = omitted("KV admission: the stage that said no")
    reason: str | Absent = omitted(
        "KV admission: memory, sequence_cap, already_cached or rejected_by_stage"
    )
    used_bytes: int | Absent = omitted("KV admission")
    budget_bytes: int | Absent = omitted("KV admission")
    available_bytes: int | Absent = omitted("KV admission")
    active_sequences: int | Absent = omitted("KV admission")
    required_bytes: int | Absent = omitted("KV admission")


class ErrorResponse(ResponseModel):
    """Every error, and the last event of a stream that fails after it started."""

    error: ErrorDetail


#: the response models, in the order the OpenAPI document lists them
RESPONSE_MODELS: tuple[type[ResponseModel], ...] = (
    ChatCompletion,
    ChatCompletionChunk,
    TextCompletion,
    TextCompletionChunk,
    ModelCard,
    ModelList,
    Health,
    ErrorResponse,
)
