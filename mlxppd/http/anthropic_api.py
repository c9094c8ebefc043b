"""The Anthropic Messages API, ``POST /v1/messages``, as routes on the base app.

``add_anthropic_routes(app)`` adds it to an app built by ``base_app`` (``create_app`` builds
one): the same backend, model name, api key, limits and request log (the app's ``STATE``). A
conversation becomes one prompt through the model's chat template, rendered as
/v1/chat/completions renders it, and runs through the same ``Generation`` and
``choice_params``: at temperature 0 a message and a chat completion of one conversation say the
same thing. Every error under /v1/messages is rendered in Anthropic's shape, ``{"type":
"error", "error": {"type", "message"}}`` (``http/anthropic_message.py``'s ``ANTHROPIC_ERRORS``,
which the base app's middleware uses there), and a stream sends Anthropic's named events
(``event: message_start`` ...).

The request and response bodies are the models of ``http/anthropic_models.py``. Tools work as
in the chat API (``http/anthropic_tools.py`` maps them onto ``http/tools.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from aiohttp import web

from mlxppd.core.protocol.sampling import GrammarSpec
from mlxppd.http.anthropic_message import ANTHROPIC_ERRORS, MessageReply
from mlxppd.http.anthropic_models import (
    BLOCK_SEPARATOR,
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    Conversation,
    CountTokensRequest,
    MessagesRequest,
)
from mlxppd.http.anthropic_tools import chat_messages, tool_plan
from mlxppd.http.api_state import STATE, ApiState
from mlxppd.http.base_app import (
    admit_sequences,
    body_bytes,
    client_gone,
    read_json,
    request_log,
    serve_errors_as,
)
from mlxppd.http.chat_prompt import chat_prompt, has_chat_template
from mlxppd.http.completion import Generation
from mlxppd.http.errors import ApiError, invalid
from mlxppd.http.generation import GenerationRequest, choice_params, prompt_context
from mlxppd.http.models_api import check_model
from mlxppd.http.prompt_bound import bounded_tokens
from mlxppd.http.sse import SseWriter, failures_end_stream, send_content
from mlxppd.http.tools import ToolPlan, schema_text
from mlxppd.http.validation import validate

#: prompt tokens a prefill's continuation is detokenized after (the seam's context)
CONTINUATION_CONTEXT_TOKENS = 8
#: longest chat-template complaint passed on to the client, in characters
_MAX_TEMPLATE_ERROR_CHARS = 500

C = TypeVar("C", bound=Conversation)


def _tools(body: Conversation) -> ToolPlan:
    """The request's tools as the chat API runs them (``http/anthropic_tools.py``)."""
    try:
        return tool_plan(body.tools, body.tool_choice)
    except ValueError as exc:
        raise invalid(str(exc), "tool_choice", "invalid_value") from None


# --- the prompt ---


def _turns(body: Conversation) -> tuple[list[dict[str, Any]], bool]:
    """The chat template's messages (the system prompt first) and whether the last one, the
    assistant's, is to be continued rather than answered (Anthropic's prefill)."""
    turns: list[dict[str, Any]] = []
    if body.system:
        turns.append({"role": "system", "content": body.system})
    for message in body.messages:
        for turn in chat_messages(message.role, message.content, BLOCK_SEPARATOR):
            last = turns[-1] if turns else None
            plain = not (turn.get("tool_calls") or turn["role"] == "tool")
            if last is not None and last["role"] == turn["role"] and plain and len(last) == 2:
                # Consecutive turns of one role are one turn.
                joined = (t for t in (last["content"], turn["content"]) if t)
                turns[-1] = {"role": turn["role"], "content": BLOCK_SEPARATOR.join(joined)}
            else:
                turns.append(turn)
    continued = body.messages[-1].role == "assistant"
    if continued:
        final = turns[-1]["content"]
        if not final:  # an empty prefill: answer the turn before
            turns.pop()
            continued = False
        elif final != final.rstrip():
            raise invalid(
                "the final assistant content cannot end with whitespace",
                f"messages[{len(body.messages) - 1}].content",
                "invalid_value",
            )
    return turns, continued


async def _prompt(
    state: ApiState, body: Conversation, plan: ToolPlan, size: int
) -> tuple[list[int], bool]:
    """The prompt's tokens, and whether they end in a prefill the reply continues (``size``:
    the request body's bytes, which pick the tokenizer's lane)."""
    tokenizer = state.loaded_tokenizer()
    context = prompt_context(state)
    if not has_chat_template(tokenizer):
        raise invalid("this model has no chat template, which the Messages API needs", "messages")
    messages, continued = _turns(body)
    if continued and plan.active:
        raise invalid("a prefill cannot be combined with tools", "messages", "invalid_value")

    def render() -> list[int]:
        if not continued:  # rendered as /v1/chat/completions renders a conversation
            return chat_prompt(tokenizer, messages, plan, context)
        options = {"continue_final_message": True, "tokenize": False}
        text = tokenizer.apply_chat_template(messages, **options)
        return bounded_tokens(tokenizer, text, context, "messages", add_special_tokens=False)

    try:
        return await state.off_loop(render, size=size), continued
    except ApiError:
        raise  # too long for the context, found before tokenizing
    except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
        reason = str(exc)[:_MAX_TEMPLATE_ERROR_CHARS]
        raise invalid(f"the chat template rejected the messages: {reason}", "messages") from None


def _asked(body: MessagesRequest) -> GenerationRequest:
    """What the message asks of the model, as the chat API asks it (one choice, unseeded)."""
    form = body.output_config.format if body.output_config is not None else None
    return GenerationRequest(
        model=body.model,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences,
        # The request model bounded exactly this schema (tools.BoundedSchema).
        grammar=GrammarSpec(kind="json_schema", schema_text=schema_text(form.schema_))
        if form is not None
        else None,
    )


class _EventWriter(SseWriter):
    """Server-sent events with names, as Anthropic streams: ``event: <type>`` then the data."""

    @classmethod
    async def start(cls, request: web.Request, headers: dict[str, str]) -> _EventWriter:
        return cls((await cls.open(request, headers)).response)

    async def send(self, payload: dict[str, Any]) -> None:
        await self.named(payload["type"], payload)


# --- handlers ---


@dataclass(frozen=True)
class _Prompted(Generic[C]):
    """A request's body, checked, and the prompt it makes."""

    body: C
    plan: ToolPlan
    prompt: list[int]
    #: the prompt ends in a prefill the reply continues
    continued: bool


async def _prompted(request: web.Request, state: ApiState, model: type[C]) -> _Prompted[C]:
    body = validate(model, await read_json(request))
    check_model(state, body.model)
    plan = _tools(body)
    prompt, continued = await _prompt(state, body, plan, body_bytes(request))
    return _Prompted(body, plan, prompt, continued)


async def _messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    prompted = await _prompted(request, state, MessagesRequest)
    body, plan, prompt = prompted.body, prompted.plan, prompted.prompt
    asked = _asked(body)
    if plan.forced and asked.grammar is not None:
        raise invalid("a forced tool call and an output format cannot both hold", "tool_choice")
    (params,) = choice_params(state, asked, len(prompt), "messages", plan)
    await admit_sequences(request, 1)
    request_id = request_log(request).request_id
    events = state.backend.generate(request_id, prompt, params)
    # A prefill's reply is detokenized after the prompt's last tokens, to space the seam.
    seam = prompt[-CONTINUATION_CONTEXT_TOKENS:] if prompted.continued else ()
    gen = Generation(
        events, state.backend.tokenizer, len(prompt), asked.stop, client_gone(request),
        continues=seam,
    )  # fmt: skip
    message = MessageReply(params.adapter or state.model_name, plan)
    try:
        await gen.start()  # admission: a refusal is a plain error response, even when streaming
        if body.stream:
            return await _stream(request, gen, message)
        await gen.collect()
        return web.json_response(message.complete(gen), headers={"request-id": request_id})
    finally:
        await gen.close()
        request_log(request).tokens = (len(prompt), gen.completion_tokens)


async def _stream(
    request: web.Request, gen: Generation, message: MessageReply
) -> web.StreamResponse:
    request_id = request_log(request).request_id
    sse = await _EventWriter.start(request, {"X-Request-Id": request_id, "request-id": request_id})

    async def send_error(error: ApiError) -> None:
        await sse.send(ANTHROPIC_ERRORS.body(error, request_id))
        await sse.close()

    async with failures_end_stream(request, send_error):
        for event in message.opening(gen):
            await sse.send(event)
        # With tools, text that may begin a call is held back; the calls go out at the end.
        hold = message.tools.holdback()
        await send_content(request, gen.pieces(), hold, lambda t: sse.send(message.text_delta(t)))
        for event in message.closing(gen):
            await sse.send(event)
        await sse.close()
    return sse.response


async def _count_tokens(request: web.Request) -> web.Response:
    prompted = await _prompted(request, request.app[STATE], CountTokensRequest)
    request_id = request_log(request).request_id
    counted = {"input_tokens": len(prompted.prompt)}
    return web.json_response(counted, headers={"request-id": request_id})


def add_anthropic_routes(app: web.Application) -> None:
    """Serve the Anthropic Messages API on ``app``, an app from ``base_app`` (or
    ``create_app``) not yet started: ``POST /v1/messages`` and
    ``POST /v1/messages/count_tokens``, under its api key, limits and request log, with every
    error there in Anthropic's shape."""
    if STATE not in app:
        raise ValueError("add_anthropic_routes needs an app built by create_app")
    serve_errors_as(app, MESSAGES_PATH, ANTHROPIC_ERRORS)
    app.router.add_post(MESSAGES_PATH, _messages)
    app.router.add_post(COUNT_TOKENS_PATH, _count_tokens)
