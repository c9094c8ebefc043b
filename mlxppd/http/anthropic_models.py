"""The Anthropic Messages API's bodies as pydantic models: what ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` accept (strict and bounded like ``requests.py``; a 400 names
the field) and what they send (``extra="forbid"`` like ``api_models.py``, so a field the
server adds without adding it here fails the tests). ``anthropic_api.py`` serves them;
``openapi.py`` documents them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mlxppd.core.protocol.control import MAX_SEQUENCE_TOKENS
from mlxppd.http.api_models import Absent, ResponseModel, omitted
from mlxppd.http.requests import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    ApiModel,
    Name,
    bounded_messages,
    stop_strings,
    text_parts,
    unsupported,
)
from mlxppd.http.tools import MAX_TOOLS, BoundedSchema

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
#: the status Anthropic answers "overloaded" with, where the OpenAI API answers 503
OVERLOADED_STATUS = 529
#: text blocks of one turn, and consecutive turns of one role, are joined with a blank line
BLOCK_SEPARATOR = "\n\n"

#: longest tool description, in characters
MAX_DESCRIPTION_CHARS = 8192

#: block types Anthropic defines and this server does not take: refused by name
_UNSUPPORTED_BLOCKS = frozenset(
    {
        "image",
        "document",
        "thinking",
        "redacted_thinking",
        "search_result",
        "server_tool_use",
        "web_search_tool_result",
        "container_upload",
    }
)


# --- request bodies ---


def _as_blocks(value: Any) -> Any:
    """A message's content as blocks: a string is one text block."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if isinstance(value, list) and len(value) > MAX_CONTENT_PARTS:
        # Checked before the blocks, so 100,000 tiny blocks cost one check.
        raise PydanticCustomError(
            "invalid_value", "takes at most {most} blocks", {"most": MAX_CONTENT_PARTS}
        )
    return value


def _joined_text(value: Any) -> Any:
    """``system`` or a tool result's ``content`` as one string: a string, or text blocks
    joined with a blank line; null is empty."""
    return "" if value is None else text_parts(value, BLOCK_SEPARATOR, "block")


def _stop_sequences(value: Any) -> Any:
    return stop_strings(value, one_string=False)


JoinedText = Annotated[
    str, BeforeValidator(_joined_text, json_schema_input_type=str | list[dict[str, Any]] | None)
]
StopSequences = Annotated[
    tuple[str, ...], BeforeValidator(_stop_sequences, json_schema_input_type=list[str] | None)
]
#: the fields each block type needs
_NEEDS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "tool_use": ("id", "name", "input"),
    "tool_result": ("tool_use_id",),
}


class ContentBlock(ApiModel):
    """One block of a message: text, a tool call (assistant) or a tool's result (user)."""

    type: Literal["text", "tool_use", "tool_result"]
    #: text
    text: str | None = None
    #: tool_use: the call's id, the tool's name, its arguments
    id: Name | None = None
    name: Name | None = None
    input: dict[str, Any] | None = None
    #: tool_result: the call answered, the tool's output as text, whether it failed
    tool_use_id: Name | None = None
    content: JoinedText = ""
    is_error: bool = False

    @field_validator("type", mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        if isinstance(value, str) and value in _UNSUPPORTED_BLOCKS:
            raise unsupported(f"a block of type '{value}'")
        return value

    @model_validator(mode="after")
    def _complete(self) -> ContentBlock:
        for name in _NEEDS[self.type]:
            if getattr(self, name) is None:
                raise PydanticCustomError(
                    "invalid_value",
                    "a {kind} block needs '{field}'",
                    {"kind": self.type, "field": name},
                )
        return self


class MessageParam(ApiModel):
    role: Literal["user", "assistant"]
    content: Annotated[
        list[ContentBlock],
        BeforeValidator(_as_blocks, json_schema_input_type=str | list[ContentBlock]),
    ] = Field(description="a string, or up to 256 blocks")


class ToolDefinition(ApiModel):
    """A tool the client runs: its name, what it does, its input's JSON schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    input_schema: BoundedSchema
    type: Literal["custom"] | None = None


class ToolChoice(ApiModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise PydanticCustomError("invalid_value", "type 'tool' needs the tool's 'name'")
        return self


class ThinkingConfig(ApiModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=MAX_SEQUENCE_TOKENS)

    @field_validator("type")
    @classmethod
    def _off_only(cls, value: str) -> str:
        if value != "disabled":
            raise unsupported("extended thinking")
        return value


class OutputFormat(ApiModel):
    """Structured output (the SDK's ``messages.parse(output_format=...)``): the reply's text
    held to a JSON schema by the same grammar as OpenAI's ``response_format``."""

    type: Literal["json_schema"]
    schema_: BoundedSchema = Field(alias="schema", description="the JSON schema to follow")


class OutputConfig(ApiModel):
    #: how hard the model should think: a hint this server accepts and ignores
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Conversation(ApiModel):
    """The prompt's parts, which /v1/messages and /v1/messages/count_tokens share."""

    model: Name
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: JoinedText = Field("", description="a string, or text blocks")
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        return bounded_messages(value)


class MessagesRequest(Conversation):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1, le=MAX_SEQUENCE_TOKENS)
    stop_sequences: StopSequences = ()
    temperature: float = Field(1.0, ge=0, le=1, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=1 << 24, description="keep the k most likely tokens (0: all)")
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")


class CountTokensRequest(Conversation):
    """POST /v1/messages/count_tokens."""


# --- response bodies ---

#: why a message ended: the model's end of turn, max_tokens, a stop sequence, tool calls
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(ResponseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(ResponseModel):
    """A tool call: its id (for the tool_result), the tool, its arguments."""

    type: Literal["tool_use"]
    id: str = Field(description='"toolu_..."')
    name: str
    input: dict[str, Any] = Field(description="the arguments, valid under the tool's schema")


AssistantBlock = Annotated[TextBlock | ToolUseBlock, Field(discriminator="type")]


class MessageUsage(ResponseModel):
    input_tokens: int = Field(ge=0, description="the prompt's tokens")
    output_tokens: int = Field(ge=0, description="tokens generated (0 in message_start)")


class Message(ResponseModel):
    """The body of a message, and in a stream's message_start the message as it begins
    (no content, stop_reason null, output_tokens 0)."""

    id: str = Field(description='"msg_..."')
    type: Literal["message"]
    role: Literal["assistant"]
    model: str = Field(description="the model name clients see (the alias)")
    content: list[AssistantBlock] = Field(description="text first (if any), then tool calls")
    stop_reason: StopReason | None = Field(description="null only in message_start")
    stop_sequence: str | None = Field(description="the stop sequence that ended the message")
    usage: MessageUsage


class MessageTokensCount(ResponseModel):
    """The body of POST /v1/messages/count_tokens."""

    input_tokens: int = Field(ge=0, description="the prompt tokens the same message would use")


class MessageStartEvent(ResponseModel):
    type: Literal["message_start"]
    message: Message


class ContentBlockStartEvent(ResponseModel):
    """A block begins: text at index 0 (empty), then each tool_use with input {}."""

    type: Literal["content_block_start"]
    index: int = Field(ge=0)
    content_block: AssistantBlock


class TextDelta(ResponseModel):
    type: Literal["text_delta"]
    text: str


class InputJsonDelta(ResponseModel):
    type: Literal["input_json_delta"]
    partial_json: str = Field(description="the tool call's input as JSON text (whole, here)")


class ContentBlockDeltaEvent(ResponseModel):
    type: Literal["content_block_delta"]
    index: int = Field(ge=0)
    delta: Annotated[TextDelta | InputJsonDelta, Field(discriminator="type")]


class ContentBlockStopEvent(ResponseModel):
    type: Literal["content_block_stop"]
    index: int = Field(ge=0)


class PingEvent(ResponseModel):
    type: Literal["ping"]


class MessageDeltaBody(ResponseModel):
    stop_reason: StopReason
    stop_sequence: str | None


class OutputUsage(ResponseModel):
    output_tokens: int = Field(ge=0)


class MessageDeltaEvent(ResponseModel):
    """The message's end: why it stopped and the tokens generated."""

    type: Literal["message_delta"]
    delta: MessageDeltaBody
    usage: OutputUsage


class MessageStopEvent(ResponseModel):
    type: Literal["message_stop"]


class AnthropicErrorDetail(ResponseModel):
    type: str = Field(
        description=(
            "invalid_request_error, authentication_error, not_found_error, request_too_large, "
            "overloaded_error, api_error"
        )
    )
    message: str = Field(description='starts with the field at fault, e.g. "max_tokens: ..."')


class AnthropicError(ResponseModel):
    """Every error under /v1/messages, and the last event of a stream that fails after it
    started."""

    type: Literal["error"]
    error: AnthropicErrorDetail
    request_id: str | Absent = omitted("the request's id, as the log names it")


#: the events of a streamed message, in the order they come (ping after the first block's start)
STREAM_EVENTS: tuple[type[ResponseModel], ...] = (
    MessageStartEvent,
    ContentBlockStartEvent,
    PingEvent,
    ContentBlockDeltaEvent,
    ContentBlockStopEvent,
    MessageDeltaEvent,
    MessageStopEvent,
)
#: the response models, in the order the OpenAPI document lists them
RESPONSE_MODELS: tuple[type[ResponseModel], ...] = (
    Message,
    MessageTokensCount,
    *STREAM_EVENTS,
    AnthropicError,
)
