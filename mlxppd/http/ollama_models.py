"""The Ollama API's request bodies as pydantic models: what ``POST /api/chat``,
``/api/generate`` and ``/api/show`` accept (strict and bounded like ``requests.py``; a 400
names the field), and ``options`` mapped onto the sampler (``OllamaOptions``).

What the ``ollama`` Python client (0.6.3) may send is accepted: it dumps its own models with
``exclude_none``, so only the fields a caller set arrive. Fields Ollama defines for what this
server does not do (images, thinking, image generation, a ``context`` to continue) are
refused unless neutral. ``ollama_api.py`` serves these; ``ollama_openapi.py`` documents them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mlxppd.core.protocol.control import MAX_SEED, MAX_SEQUENCE_TOKENS
from mlxppd.http.requests import (
    MAX_MESSAGES,
    ApiModel,
    Name,
    StopStrings,
    bounded_messages,
    unsupported,
)
from mlxppd.http.tools import MAX_TOOLS, BoundedSchema, FunctionName, ToolDef

#: longest prompt, system or template text, in characters (the context bounds it again)
MAX_TEXT_CHARS = 4 * 1024 * 1024
#: mlx-lm's penalties look at the last 20 tokens; another window is refused
PENALTY_WINDOW = 20

#: Ollama's options that size or place the runner, not the answer: accepted and ignored
#: (the cluster's own settings decide them; ``num_ctx`` is the served context)
RUNNER_OPTIONS = frozenset(
    {
        "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv",
        "logits_all", "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread",
        "num_keep", "penalize_newline",
    }
)  # fmt: skip
#: Ollama's sampling options this sampler does not have, with the value that leaves the
#: answer as it is: accepted at that value, refused at any other
NEUTRAL_OPTIONS: dict[str, float] = {"tfs_z": 1.0, "typical_p": 1.0, "mirostat": 0}


def _text(most: int = MAX_TEXT_CHARS) -> Any:
    return Field(None, max_length=most)


class OllamaOptions(ApiModel):
    """``options``: the sampler's settings, with Ollama's defaults (temperature 0.8, top_k 40,
    top_p 0.9); ``num_predict`` -1 or -2 is the server's default length."""

    temperature: float = Field(0.8, ge=0, le=2, description="0: greedy")
    top_p: float = Field(0.9, gt=0, le=1)
    top_k: int = Field(40, ge=0, le=1 << 24, description="0: all tokens")
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-1, le=MAX_SEED, description="-1: unseeded")
    num_predict: int | None = Field(None, ge=-2, le=MAX_SEQUENCE_TOKENS)
    stop: StopStrings = ()
    repeat_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repeat_last_n: int | None = Field(None, ge=-1, le=MAX_SEQUENCE_TOKENS)
    tfs_z: float | None = None
    typical_p: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        """Runner options go; an option not known here may change the answer: refused."""
        if not isinstance(value, dict):
            return value
        unknown = sorted(k for k in value if k not in cls.model_fields and k not in RUNNER_OPTIONS)
        if unknown:
            names = ", ".join(str(k)[:64] for k in unknown[:8])
            raise PydanticCustomError(
                "unsupported",
                "{names}: not options this server knows; remove them (they may change the answer)",
                {"names": names},
            )
        return {k: v for k, v in value.items() if k not in RUNNER_OPTIONS}

    @model_validator(mode="after")
    def _neutral(self) -> OllamaOptions:
        for name, neutral in NEUTRAL_OPTIONS.items():
            given = getattr(self, name)
            if given is not None and given != neutral:
                raise unsupported(f"'{name}' other than {neutral:g}")
        penalized = (
            self.repeat_penalty not in (None, 1.0)
            or self.presence_penalty
            or self.frequency_penalty
        )
        if penalized and self.repeat_last_n not in (None, PENALTY_WINDOW):
            raise unsupported(f"'repeat_last_n' other than {PENALTY_WINDOW} with a penalty")
        return self

    @property
    def max_tokens(self) -> int | None:
        """num_predict as max_tokens (None: the server's default)."""
        return self.num_predict if self.num_predict and self.num_predict > 0 else None


class OllamaToolCallFunction(ApiModel):
    name: FunctionName
    arguments: BoundedSchema = Field(description="the arguments, an object")


class OllamaToolCall(ApiModel):
    function: OllamaToolCallFunction


def _off(what: str) -> BeforeValidator:
    """A field taken only at its neutral value (absent, false, empty): ``what`` otherwise."""

    def check(value: Any) -> Any:
        if value not in (None, False, "", []):
            raise unsupported(what)
        return value

    return BeforeValidator(check)


NoImages = Annotated[list[Any] | None, _off("images")]


class OllamaMessage(ApiModel):
    """One turn; a tool's result is a ``tool`` message (``tool_name``: the tool it answers)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field("", max_length=MAX_TEXT_CHARS)
    #: an earlier answer's thinking: not part of the prompt
    thinking: str | None = _text()
    images: NoImages = None
    tool_calls: list[OllamaToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_name: Name | None = None

    @model_validator(mode="after")
    def _calls_by_assistant(self) -> OllamaMessage:
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("invalid_value", "only assistant messages carry tool_calls")
        return self


def _format(value: Any) -> Any:
    if value in (None, ""):
        return None
    if value == "json" or isinstance(value, dict):
        return value
    raise PydanticCustomError("invalid_value", 'must be "json" or a JSON schema object')


Format = Annotated[
    Literal["json"] | BoundedSchema | None,
    BeforeValidator(_format, json_schema_input_type=Literal["", "json"] | dict[str, Any] | None),
]


class _Generating(ApiModel):
    """What /api/chat and /api/generate share."""

    model: Name
    stream: bool = Field(True, description="NDJSON lines (the default), or one JSON object")
    format: Format = Field(None, description='"json", or a JSON schema the answer follows')
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    #: the model stays loaded whatever is asked
    keep_alive: float | Annotated[str, Field(max_length=32)] | None = None
    think: Annotated[bool | Annotated[str, Field(max_length=16)] | None, _off("'think'")] = None
    logprobs: Annotated[bool | None, _off("'logprobs' (use /v1/chat/completions)")] = None
    top_logprobs: int | None = Field(None, ge=0, le=0)


class OllamaChatRequest(_Generating):
    """POST /api/chat. No messages: the model is loaded (it always is), nothing generated."""

    messages: list[OllamaMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: list[ToolDef] = Field(default_factory=list, max_length=MAX_TOOLS)

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        return bounded_messages(value)


class OllamaGenerateRequest(_Generating):
    """POST /api/generate. No prompt: the model is loaded, nothing generated."""

    prompt: str | None = _text()
    system: str | None = _text()
    #: Ollama's Go template; only ``{{ .System }}``, ``{{ .Prompt }}``, ``{{ .Response }}``
    template: str | None = _text()
    raw: bool = Field(False, description="the prompt as is, without the chat template")
    suffix: Annotated[str | None, _off("'suffix'")] = None
    context: Annotated[list[int] | None, _off("'context' (send the turns to /api/chat)")] = None
    images: NoImages = None
    width: Annotated[int | None, _off("image generation")] = None
    height: Annotated[int | None, _off("image generation")] = None
    steps: Annotated[int | None, _off("image generation")] = None


class OllamaShowRequest(ApiModel):
    """POST /api/show (``name`` is what older clients send)."""

    model: Name | None = None
    name: Name | None = None
    verbose: bool = False

    @model_validator(mode="after")
    def _named(self) -> OllamaShowRequest:
        if not (self.model or self.name):
            raise PydanticCustomError("missing", "model is required")
        return self
