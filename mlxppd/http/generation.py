"""From a request, in neither API's words, to what the backend runs: ``GenerationRequest``
(what the OpenAI API parses into, and what the Anthropic API builds) and ``choice_params``,
its max_tokens checked against the context and one ``SamplingParams`` per choice."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxppd.core.protocol.sampling import GrammarSpec
from mlxppd.http.api_state import ApiState
from mlxppd.http.errors import ApiError, invalid
from mlxppd.http.models_api import adapter_registry, check_model
from mlxppd.http.tools import ToolPlan, schema_text
from mlxppd.runtime.backends.contract import RequestRefused, SamplingParams

#: prompt tokens a server takes when neither it nor the tokenizer knows the context
FALLBACK_MAX_PROMPT_TOKENS = 32_768
#: how the seeds of a request's choices differ (an odd 64-bit constant: distinct for any n)
SEED_STRIDE = 0x9E3779B97F4A7C15


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """What a request asks of the model, already checked: its length, sampling and stops."""

    #: the model or adapter name the request gave (None: the served model)
    model: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    n: int = 1
    top_logprobs: int = 0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: the output constrained to JSON (response_format json_object / json_schema)
    grammar: GrammarSpec | None = None


def prompt_context(state: ApiState) -> int:
    """The most prompt tokens the server takes: the context, or the fallback when unknown."""
    return state.context() or FALLBACK_MAX_PROMPT_TOKENS


def choice_params(
    state: ApiState,
    asked: GenerationRequest,
    n_prompt: int,
    prompt_param: str,
    tools: ToolPlan | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per choice of a prompt of ``n_prompt`` tokens; a 400 naming
    ``prompt_param`` (or max_tokens) when the prompt and the completion do not fit."""
    if asked.n > state.max_choices_per_request:
        raise invalid(
            f"n is {asked.n} and this server gives at most {state.max_choices_per_request} "
            "choices per request (its --max-choices-per-request); ask for fewer",
            "n",
            "too_many_choices",
        )
    max_tokens = _max_tokens(state, asked, n_prompt, prompt_param)
    return _per_choice(state, asked, max_tokens, tools or ToolPlan())


def _max_tokens(state: ApiState, asked: GenerationRequest, n_prompt: int, param: str) -> int:
    """The request's max_tokens after checking prompt and completion against the context."""
    if n_prompt == 0:
        raise invalid("the prompt is empty", param, "invalid_value")
    context = state.context()
    if context is None:
        if n_prompt > FALLBACK_MAX_PROMPT_TOKENS:
            raise invalid(
                f"the prompt has {n_prompt} tokens; this server takes at most "
                f"{FALLBACK_MAX_PROMPT_TOKENS}",
                param,
                "context_length_exceeded",
            )
        return asked.max_tokens or state.default_max_tokens
    if n_prompt >= context:
        raise invalid(
            f"this model's maximum context length is {context} tokens, but the prompt has "
            f"{n_prompt}",
            param,
            "context_length_exceeded",
        )
    if asked.max_tokens is None:
        return min(state.default_max_tokens, context - n_prompt)
    if n_prompt + asked.max_tokens > context:
        raise invalid(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{n_prompt} and max_tokens asks for {asked.max_tokens} more",
            "max_tokens",
            "context_length_exceeded",
        )
    return asked.max_tokens


def _per_choice(
    state: ApiState, asked: GenerationRequest, max_tokens: int, tools: ToolPlan
) -> list[SamplingParams]:
    """The request's SamplingParams, each choice with its own seed (choice 0 keeps the
    request's, so n=1 draws what it always drew). The request's ``model`` picks a per-request
    adapter when it names one; any other name is the base model."""
    registry = adapter_registry(state.backend)
    try:
        adapter = registry.chosen(asked.model) if registry is not None else None
    except RequestRefused as exc:
        raise ApiError(409, str(exc), param="model", code="adapter_unloading") from None
    if adapter is None:
        check_model(state, asked.model)  # an adapter unloaded since: 404, not the base model
    base = SamplingParams(
        adapter=adapter,
        max_tokens=max_tokens,
        temperature=asked.temperature,
        top_p=asked.top_p,
        seed=asked.seed,
        logprobs=asked.logprobs,
        top_k=asked.top_k,
        min_p=asked.min_p,
        repetition_penalty=asked.repetition_penalty,
        presence_penalty=asked.presence_penalty,
        frequency_penalty=asked.frequency_penalty,
        logit_bias=asked.logit_bias,
        top_logprobs=asked.top_logprobs,
        grammar=_grammar(asked, tools),
    )
    if asked.seed is None:
        return [base] * asked.n
    return [replace(base, seed=(asked.seed + i * SEED_STRIDE) % (1 << 64)) for i in range(asked.n)]


def _grammar(asked: GenerationRequest, tools: ToolPlan) -> GrammarSpec | None:
    """The output's grammar: a forced tool call's, or the response_format's."""
    if (schema := tools.call_grammar()) is None:
        return asked.grammar
    try:
        text = schema_text(schema)  # each tool's schema fits; several together may not
    except ValueError as exc:
        raise invalid(
            f"the forced tool call's schema (the parameters of every tool it may call): {exc}",
            "tool_choice",
            "invalid_value",
        ) from None
    return GrammarSpec(kind="json_schema", schema_text=text)
