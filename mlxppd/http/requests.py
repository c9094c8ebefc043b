"""The bodies of /v1/chat/completions and /v1/completions as pydantic models.

Every field is typed strictly (``"8"`` is not an integer, ``1`` is not a boolean) and bounded,
so nothing a client sends reaches tokenizing, admission or a stage unchecked. Fields that
OpenAI defines and this server does not implement are accepted at their neutral value and
refused otherwise (``unsupported``), never silently ignored; fields OpenAI does not define
are ignored, as OpenAI's SDKs add new ones often. ``validation.py`` turns these models'
errors into OpenAI-shaped 400s naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mlxppd.core.fair_share import MAX_CHOICES_PER_REQUEST
from mlxppd.core.protocol.control import MAX_SEED, MAX_SEQUENCE_TOKENS
from mlxppd.http.tools import MAX_TOOLS, BoundedSchema, ToolCallIn, ToolChoice, ToolDef

#: most messages in one chat request (a long agent transcript has a few hundred)
MAX_MESSAGES = 2048
#: most content parts in one message
MAX_CONTENT_PARTS = 256
MAX_STOP_STRINGS = 4
#: longest stop string, in characters
MAX_STOP_CHARS = 512
#: longest identifier-like string (model, user, a message's name), in characters
MAX_NAME_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
#: most choices per request (each holds its own KV after the shared prompt)
MAX_CHOICES = MAX_CHOICES_PER_REQUEST
#: most logit_bias entries, as OpenAI allows
MAX_LOGIT_BIAS = 300
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError(
        "unsupported", "{what} is not supported by this server", {"what": what}
    )


def stop_strings(value: Any, one_string: bool = True) -> Any:
    """Stop strings as a bounded tuple (``one_string``: a lone string is a list of one);
    empty ones never match, so they are dropped, as OpenAI and Anthropic do."""
    if value is None:
        return ()
    items = [value] if one_string and isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        kinds = "a string or a list of strings" if one_string else "a list of strings"
        raise PydanticCustomError("invalid_type", f"must be {kinds}")
    if len(items) > MAX_STOP_STRINGS:
        raise PydanticCustomError(
            "invalid_value",
            "takes at most {most} strings, got {got}",
            {"most": MAX_STOP_STRINGS, "got": len(items)},
        )
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise PydanticCustomError(
            "invalid_value", "a stop string is at most {most} characters", {"most": MAX_STOP_CHARS}
        )
    return tuple(s for s in items if s)


def text_parts(value: Any, joiner: str = "", noun: str = "part") -> Any:
    """Content as one string: a string, or a list of at most MAX_CONTENT_PARTS text
    ``noun``s (OpenAI's parts, Anthropic's blocks) joined with ``joiner``."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("invalid_type", f"must be a string or a list of text {noun}s")
    if len(value) > MAX_CONTENT_PARTS:
        # Checked before the parts, so 100,000 tiny parts cost one check.
        raise PydanticCustomError(
            "invalid_value", f"takes at most {{most}} {noun}s", {"most": MAX_CONTENT_PARTS}
        )
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise unsupported(f"content other than text {noun}s")
        text = part.get("text")
        if not isinstance(text, str):
            raise PydanticCustomError("invalid_type", f"a text {noun} needs a string 'text'")
        texts.append(text)
    return joiner.join(texts)


def _optional_content_text(value: Any) -> Any:
    return None if value is None else text_parts(value)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, populate_by_name=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] = "response"
    description: str | None = Field(None, max_length=4096)
    schema_: BoundedSchema = Field(alias="schema", description="the JSON schema to follow")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing", "json_schema is required for this type")
        return self


def _prompt(value: Any) -> Any:
    """A string, or one list of token ids; a batch of exactly one prompt is that prompt."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_token_id(t) for t in value):
        return value
    raise PydanticCustomError(
        "invalid_value",
        "must be a string or one non-empty list of token ids (batches are not supported)",
    )


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32


def _logit_bias(value: Any) -> Any:
    """OpenAI's {"token id": bias} as sorted (id, bias) pairs; biases in [-100, 100]."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise PydanticCustomError("invalid_type", "must be an object of token id -> bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise PydanticCustomError(
            "invalid_value", "takes at most {most} entries", {"most": MAX_LOGIT_BIAS}
        )
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 10):
            raise PydanticCustomError("invalid_value", 'keys are token ids, like "50256"')
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise PydanticCustomError("invalid_value", "a bias is a number from -100 to 100")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


StopStrings = Annotated[
    tuple[str, ...],
    BeforeValidator(stop_strings, json_schema_input_type=str | list[str] | None),
]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
LogitBias = Annotated[
    tuple[tuple[int, float], ...],
    BeforeValidator(_logit_bias, json_schema_input_type=dict[str, float] | None),
]


class ApiModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class StreamOptions(ApiModel):
    include_usage: bool = Field(False, description="send a last chunk with the token counts")


class ChatMessage(ApiModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[
        str | None,
        BeforeValidator(
            _optional_content_text, json_schema_input_type=str | list[dict[str, Any]] | None
        ),
    ] = Field(
        None, validate_default=True, description="text, or a list of {type: text, text} parts"
    )
    name: Name | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: Annotated[str, Field(max_length=128)] | None = None

    @field_validator("content")
    @classmethod
    def _content_given(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") != "assistant":
            raise PydanticCustomError("missing", "is required")
        return value

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise PydanticCustomError(
                "missing", "content is required (it may be null only beside tool_calls)"
            )
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("invalid_value", "only assistant messages carry tool_calls")
        return self


class _Common(ApiModel):
    """The fields both endpoints share."""

    model: Name | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_SEQUENCE_TOKENS)
    temperature: float = Field(1.0, ge=0, le=2, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices; the prompt is prefilled once")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopStrings = ()
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    presence_penalty: float = Field(
        0.0, ge=-2, le=2, description="subtracted from each token seen in the last 20"
    )
    frequency_penalty: float = Field(
        0.0, ge=-2, le=2, description="subtracted per occurrence in the last 20 tokens"
    )
    logit_bias: LogitBias = Field(
        (), description='{"token id": bias}, bias from -100 to 100, added to the logit'
    )
    # Beyond OpenAI, as vLLM and mlx_lm.server take them (the SDKs send them in extra_body).
    top_k: int = Field(0, ge=0, le=1 << 24, description="keep the k most likely tokens (0: all)")
    min_p: float = Field(0.0, ge=0, le=1, description="drop tokens below min_p x the top one")
    repetition_penalty: float | None = Field(
        None, gt=0, le=10, description="mlx-lm's multiplicative penalty over the last 20 tokens"
    )
    functions: list[dict[str, Any]] | None = Field(None, max_length=128)
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema: the output follows the schema"
    )

    @field_validator("functions")
    @classmethod
    def _empty_only(cls, value: Any) -> Any:
        if value:
            raise unsupported("'functions' (use 'tools')")
        return value


def bounded_messages(value: Any) -> Any:
    """A request's ``messages``, refused when too many before any is validated: 100,000 tiny
    messages must not cost 100,000 validations."""
    if isinstance(value, list) and len(value) > MAX_MESSAGES:
        raise PydanticCustomError(
            "invalid_value",
            "takes at most {most} messages, got {got}",
            {"most": MAX_MESSAGES, "got": len(value)},
        )
    return value


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_SEQUENCE_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named function"
    )
    parallel_tool_calls: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        return bounded_messages(value)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: Annotated[
        str | list[int],
        BeforeValidator(_prompt, json_schema_input_type=str | list[int] | list[str]),
    ]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int = Field(1, ge=1, le=1)
    echo: bool = False
    suffix: str | None = Field(None, max_length=MAX_NAME_CHARS)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise unsupported("'echo'")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise unsupported("'suffix'")
        return value
