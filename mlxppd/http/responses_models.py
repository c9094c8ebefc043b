"""The body of ``POST /v1/responses`` (OpenAI's Responses API) as pydantic models.

Strict and bounded like ``requests.py``: every string, list and number has a limit, and a 400
names the field at fault (``validation.validate``). Unlike the chat API's bodies an unknown
field is refused by name (``extra="forbid"``): the fields here are all that the ``openai``
SDK's ``responses.create`` and the ``openai-agents`` SDK's ``OpenAIResponsesModel`` send.
Fields OpenAI defines for features this server does not have (built-in tools, reusable
prompts, conversations, background runs) are taken at their neutral value and refused
otherwise (``unsupported``); hints with nothing to act on here (``service_tier``,
``prompt_cache_key``, ``reasoning.effort``, ``text.verbosity``...) are accepted.

"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)
from pydantic_core import PydanticCustomError

from mlxppd.core.protocol.control import MAX_SEQUENCE_TOKENS
from mlxppd.http.requests import MAX_CONTENT_PARTS, MAX_MESSAGES, ApiModel, Name, unsupported
from mlxppd.http.tools import MAX_TOOLS, BoundedSchema, FunctionName

RESPONSES_PATH = "/v1/responses"
#: most items in ``input`` (as many as a chat request's messages)
MAX_INPUT_ITEMS = MAX_MESSAGES
#: longest text of one field (instructions, a content part, a tool's output), in characters
MAX_TEXT_CHARS = 1 << 22
#: longest id a client sends back (an item's, a call's, a response's), in characters
MAX_ID_CHARS = 128
#: OpenAI's bounds on ``metadata``: pairs, key and value characters
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: longest ``include`` list (OpenAI defines fewer values than this)
MAX_INCLUDE = 16
#: the input items this server takes; any other type OpenAI defines is refused by name
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")
#: the content parts it takes (text); images, files and audio are refused by name
CONTENT_PART_TYPES = ("input_text", "output_text", "refusal")

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
ItemId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class RequestModel(ApiModel):
    """A part of the request: strict, and an unknown key is refused by name."""

    model_config = ConfigDict(extra="forbid")


def _too_many(what: str, most: int, got: int) -> PydanticCustomError:
    return PydanticCustomError(
        "invalid_value",
        "takes at most {most} {what}, got {got}",
        {"most": most, "what": what, "got": got},
    )


def _typed_list(value: Any, most: int, what: str, known: tuple[str, ...], default: str) -> Any:
    """A list of at most ``most`` objects whose ``type`` (``default`` when absent) is one of
    ``known``; refused before any is validated, so 100,000 tiny items cost one check."""
    if not isinstance(value, list):
        return value
    if len(value) > most:
        raise _too_many(what, most, len(value))
    for index, item in enumerate(value):
        kind = item.get("type", default) if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in known:
            raise PydanticCustomError(
                "unsupported",
                "{what} {index} has type '{kind}', which this server does not take (it "
                "takes {known})",
                {"what": what[:-1], "index": index, "kind": kind[:64], "known": ", ".join(known)},
            )
    return value


# --- input items ---


#: each content part's keys (the first is its text); any other key is refused by name
_PART_KEYS = {
    "input_text": ("text", "type", "prompt_cache_breakpoint"),
    "output_text": ("text", "type", "annotations", "logprobs"),
    "refusal": ("refusal", "type"),
}


def _content(value: Any) -> Any:
    """A message's content as one string: a string, or up to MAX_CONTENT_PARTS text parts
    (input_text, output_text, refusal) joined; images, files and audio are refused."""
    if not isinstance(value, list):
        return value
    _typed_list(value, MAX_CONTENT_PARTS, "parts", CONTENT_PART_TYPES, "")
    texts = []
    for index, part in enumerate(value):
        keys = _PART_KEYS.get(str(part.get("type"))) if isinstance(part, dict) else None
        if keys is None:
            raise PydanticCustomError(
                "invalid_type", "part {index} is not an object with a known 'type'",
                {"index": index},
            )  # fmt: skip
        if unknown := sorted(set(part) - set(keys)):
            raise PydanticCustomError(
                "extra_forbidden", "part {index} has unknown field '{key}'",
                {"index": index, "key": str(unknown[0])[:64]},
            )  # fmt: skip
        text = part.get(keys[0])
        if not isinstance(text, str):
            raise PydanticCustomError(
                "invalid_type", "part {index} needs a string '{key}'",
                {"index": index, "key": keys[0]},
            )  # fmt: skip
        texts.append(text)
    return "".join(texts)


class InputText(RequestModel):
    type: Literal["input_text"]
    text: Text
    #: explicit prompt-cache breakpoints: this server's cache finds prefixes by itself
    prompt_cache_breakpoint: dict[str, Literal["explicit"]] | None = None


class OutputText(RequestModel):
    """An assistant's text, as a response's output gives it (sent back by clients)."""

    type: Literal["output_text"]
    text: Text
    annotations: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_CONTENT_PARTS)
    logprobs: list[dict[str, Any]] | None = Field(None, max_length=MAX_SEQUENCE_TOKENS)


class Refusal(RequestModel):
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(RequestModel):
    """A message: ``{"role", "content"}`` (OpenAI's easy form), or as a response's output or
    the input items list gives it (``type``, ``id``, ``status``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"] = Field(
        description="developer is the system role"
    )
    content: Annotated[
        Text, BeforeValidator(_content, json_schema_input_type=str | list[ContentPart])
    ] = Field(description="a string, or up to 256 input_text / output_text / refusal parts")
    id: ItemId | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class _ToolItem(RequestModel):
    """What a function call and its output share: the call they belong to."""

    call_id: ItemId
    id: ItemId | None = None
    status: ItemStatus | None = None
    namespace: Name | None = None
    caller: dict[str, str] | None = Field(None, max_length=2)
    created_by: Name | None = None


class FunctionCallItem(_ToolItem):
    """A call the model made, sent back with the conversation."""

    type: Literal["function_call"]
    name: FunctionName
    arguments: str = Field(max_length=1 << 20, description="the arguments as JSON text")


def _output_text(value: Any) -> Any:
    """A tool's output: a string, or input_text parts joined (images and files refused)."""
    if not isinstance(value, list):
        return value
    _typed_list(value, MAX_CONTENT_PARTS, "parts", ("input_text",), "")
    texts = [p.get("text") if isinstance(p, dict) else None for p in value]
    if not all(isinstance(t, str) for t in texts):
        raise PydanticCustomError("invalid_type", "an input_text part needs a string 'text'")
    return "".join(texts)  # type: ignore[arg-type]


class FunctionCallOutputItem(_ToolItem):
    """What the client's function returned for a call."""

    type: Literal["function_call_output"]
    output: Annotated[
        Text,
        BeforeValidator(_output_text, json_schema_input_type=str | list[InputText]),
    ] = Field(description="text, or input_text parts")
    name: FunctionName | None = None


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


def _input(value: Any) -> Any:
    return _typed_list(value, MAX_INPUT_ITEMS, "items", INPUT_ITEM_TYPES, "message")


# --- tools, tool choice, text format ---


class FunctionTool(RequestModel):
    """A function the client runs (``tools`` of type function)."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = Field(None, max_length=8192)
    parameters: BoundedSchema | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = Field(None, max_length=2)
    #: a schema of what the function returns: only a description for the model's side
    output_schema: BoundedSchema | None = None

    @field_validator("defer_loading")
    @classmethod
    def _loaded(cls, value: bool | None) -> bool | None:
        if value:
            raise unsupported("'defer_loading' (there is no tool search)")
        return value


def _tools(value: Any) -> Any:
    return _typed_list(value, MAX_TOOLS, "tools", ("function",), "")


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: FunctionName


class AllowedTools(RequestModel):
    """Only these of ``tools``; ``required``: one of them must be called."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[FunctionChoice] = Field(min_length=1, max_length=MAX_TOOLS)


def _tool_choice(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind not in ("function", "allowed_tools"):
        raise unsupported(f"a tool_choice of type '{kind[:64]}' (only functions are served)")
    return value


ToolChoiceParam = Annotated[
    Literal["none", "auto", "required"]
    | Annotated[FunctionChoice | AllowedTools, Field(discriminator="type")],
    BeforeValidator(_tool_choice),
]


class FormatText(RequestModel):
    type: Literal["text"]


class FormatJsonObject(RequestModel):
    type: Literal["json_object"]


class FormatJsonSchema(RequestModel):
    """The output follows ``schema`` (the grammar on the last stage holds it there)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema_: BoundedSchema = Field(alias="schema", description="the JSON schema to follow")
    description: str | None = Field(None, max_length=4096)
    strict: bool | None = None


TextFormat = Annotated[
    FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")
]


class TextConfig(RequestModel):
    format: TextFormat | None = None
    #: a hint to a model that can be terse or wordy; this one writes what it writes
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(RequestModel):
    """Hints for reasoning models; this model does not reason (reasoning_tokens is 0)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: Annotated[str, Field(max_length=64)] | None = None


class StreamOptions(RequestModel):
    #: random padding against length side channels: nothing here measures lengths for others
    include_obfuscation: bool | None = None


class PromptCacheOptions(RequestModel):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


def _metadata(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) > MAX_METADATA_PAIRS:
            raise _too_many("pairs", MAX_METADATA_PAIRS, len(value))
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise PydanticCustomError(
                    "invalid_value", "a key is at most {most} characters",
                    {"most": MAX_METADATA_KEY_CHARS},
                )  # fmt: skip
            if isinstance(item, str) and len(item) > MAX_METADATA_VALUE_CHARS:
                raise PydanticCustomError(
                    "invalid_value", "a value is at most {most} characters",
                    {"most": MAX_METADATA_VALUE_CHARS},
                )  # fmt: skip
    return value


MetadataKey = Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)]
MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]
Metadata = Annotated[
    dict[MetadataKey, MetadataValue],
    BeforeValidator(_metadata),
    Field(max_length=MAX_METADATA_PAIRS),
]

Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
]


def _neutral(what: str, *neutral: Any) -> Any:
    """A validator that takes only the neutral values of a feature this server does not have."""

    def check(value: Any) -> Any:
        if value is not None and value not in neutral:
            raise unsupported(what)
        return value

    return BeforeValidator(check)


class ResponsesRequest(RequestModel):
    """POST /v1/responses."""

    model: Name | None = None
    input: Annotated[
        str | list[InputItem],
        BeforeValidator(_input, json_schema_input_type=str | list[InputItem]),
    ] = Field(description="a string (one user message), or up to 2048 items")
    instructions: Text | None = Field(None, description="a system message before the input")
    previous_response_id: ItemId | None = Field(
        None, description="a stored response whose input and output come before this input"
    )
    store: bool | None = Field(None, description="keep the response for GET and follow-ups")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_SEQUENCE_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    tools: Annotated[
        list[FunctionTool], BeforeValidator(_tools, json_schema_input_type=list[FunctionTool])
    ] | None = Field(None, max_length=MAX_TOOLS)  # fmt: skip
    tool_choice: ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    metadata: Metadata | None = None
    user: Name | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    reasoning: Reasoning | None = None
    include: list[Includable] | None = Field(None, max_length=MAX_INCLUDE)
    #: a bound on built-in tool calls: there are no built-in tools here
    max_tool_calls: int | None = Field(None, ge=1, le=1 << 16)
    truncation: Annotated[
        Literal["disabled", "auto"] | None, _neutral("truncation 'auto'", "disabled")
    ] = None
    top_logprobs: Annotated[int | None, _neutral("'top_logprobs' above 0", 0)] = None
    background: Annotated[bool | None, _neutral("'background'", False)] = None
    prompt: Annotated[dict[str, Any] | None, _neutral("reusable prompts ('prompt')")] = None
    conversation: Annotated[
        str | dict[str, Any] | None, _neutral("'conversation' (use previous_response_id)")
    ] = None
    context_management: Annotated[
        list[dict[str, Any]] | None, _neutral("'context_management'", [])
    ] = None
    moderation: Annotated[dict[str, Any] | None, _neutral("'moderation'")] = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list) and not value:
            raise PydanticCustomError("invalid_value", "needs at least one item")
        return value
