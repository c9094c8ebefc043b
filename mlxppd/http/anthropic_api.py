"""The Anthropic Messages API, ``POST /v1/messages``, over the OpenAI API's backend.

``add_anthropic_routes(app)`` adds it to an app built by ``create_app``: the same backend, model
name, api key, limits and request log (the app's ``STATE``). A conversation becomes one prompt
through the model's chat template, rendered as /v1/chat/completions renders it, and runs through
the same ``Generation``: at temperature 0 a message and a chat completion of one conversation
say the same thing. Errors take Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}``, and a stream sends Anthropic's named events (``event: message_start`` ...).

The request and response bodies are the models of ``http/anthropic_models.py``. Tools work as
in the chat API (``http/anthropic_tools.py`` maps them onto ``http/tools.py``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web

from mlxppd.http.anthropic_models import (
    BLOCK_SEPARATOR,
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    OVERLOADED_STATUS,
    Conversation,
    CountTokensRequest,
    MessagesRequest,
)
from mlxppd.http.anthropic_tools import chat_messages, reply_blocks, tool_plan
from mlxppd.http.api_state import STATE, ApiState
from mlxppd.http.chat_prompt import chat_prompt
from mlxppd.http.completion import ClientGone, Generation
from mlxppd.http.errors import ApiError, from_backend_error, invalid
from mlxppd.http.models_api import check_model
from mlxppd.http.openai_api import (
    _choice_params,
    _log_of,
    _max_tokens,
    _off_loop,
    _read_json,
    _tokenizer,
)
from mlxppd.http.sse import SseWriter
from mlxppd.http.tools import ContentHoldback, ToolPlan
from mlxppd.http.validation import ParsedRequest, validate
from mlxppd.runtime.backends.contract import (
    AdmissionRejected,
    BackendUnavailable,
    SamplingParams,
    TokenEvent,
)

log = logging.getLogger("mlxppd.http")

#: prompt tokens a prefill's continuation is detokenized after (the seam's context)
CONTINUATION_CONTEXT_TOKENS = 8
#: longest chat-template complaint passed on to the client, in characters
_MAX_TEMPLATE_ERROR_CHARS = 500


def _unsupported_field(message: str, param: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="unsupported")


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


async def _prompt(state: ApiState, body: Conversation, plan: ToolPlan) -> tuple[list[int], bool]:
    """The prompt's tokens, and whether they end in a prefill the reply continues."""
    tokenizer = _tokenizer(state)
    if not (getattr(tokenizer, "has_chat_template", None) or tokenizer.chat_template):
        raise invalid("this model has no chat template, which the Messages API needs", "messages")
    messages, continued = _turns(body)
    if continued and plan.active:
        raise invalid("a prefill cannot be combined with tools", "messages", "invalid_value")

    def render() -> list[int]:
        if not continued:  # rendered as /v1/chat/completions renders a conversation
            return chat_prompt(tokenizer, messages, plan)
        options = {"continue_final_message": True}
        return [int(t) for t in tokenizer.apply_chat_template(messages, **options)]

    try:
        return await _off_loop(state, render), continued
    except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
        reason = str(exc)[:_MAX_TEMPLATE_ERROR_CHARS]
        raise invalid(f"the chat template rejected the messages: {reason}", "messages") from None


def _sampling(
    state: ApiState, body: MessagesRequest, n_prompt: int, plan: ToolPlan
) -> SamplingParams:
    """The request's sampling parameters, max_tokens checked against the context as for chat."""
    parsed = ParsedRequest(
        model=body.model,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=None,
        stop=body.stop_sequences,
        stream=body.stream,
        include_usage=False,
        logprobs=False,
        top_k=body.top_k,
    )
    max_tokens = _max_tokens(state, parsed, n_prompt, chat=True)
    return _choice_params(state, parsed, max_tokens, plan)[0]


# --- responses ---


class _ContinuedText:
    """A streaming detokenizer for text that continues the prompt's last tokens (a prefill).

    A detokenizer on its own drops the leading space of its first token, which is right for a
    new turn but loses the space between a prefill and its continuation. This one reads the
    continuation after the prompt's last tokens and hands out only what follows their text, so
    the seam is spaced as in the whole text."""

    def __init__(self, tokenizer: Any, context: Sequence[int]) -> None:
        probe = tokenizer.detokenizer  # a fresh copy per access
        for token in context:
            probe.add_token(token)
        probe.finalize()
        self._cut = len(probe.text)
        self._inner = tokenizer.detokenizer
        for token in context:
            self._inner.add_token(token)

    def add_token(self, token: int) -> None:
        self._inner.add_token(token)

    def finalize(self) -> None:
        self._inner.finalize()

    @property
    def text(self) -> str:
        text: str = self._inner.text
        return text[self._cut :]


class _MessageGeneration(Generation):
    """A ``Generation`` that also tells why it ended as Anthropic does (the stop sequence it
    matched, apart from the model's own end of turn) and can continue a prefill."""

    def __init__(
        self,
        events: AsyncIterator[TokenEvent],
        tokenizer: Any,
        prompt: Sequence[int],
        stop: Sequence[str],
        is_gone: Callable[[], bool],
        continued: bool,
    ) -> None:
        super().__init__(events, tokenizer, len(prompt), stop, is_gone)
        if continued:
            self._detok = _ContinuedText(tokenizer, prompt[-CONTINUATION_CONTEXT_TOKENS:])

    @property
    def stop_sequence(self) -> str | None:
        start = self._stop.hit
        if start is None:
            return None
        text = self._detok.text  # the text as generated, the stop sequence still in it
        found = [s for s in self._stop.stops if text.startswith(s, start)]
        return min(found, key=len) if found else self._stop.stops[0]

    @property
    def stop_reason(self) -> str:
        if self._stop.hit is not None:
            return "stop_sequence"
        return "max_tokens" if self.finish_reason == "length" else "end_turn"


class _Message:
    """Anthropic's message object and stream events for one request."""

    def __init__(self, model: str, tools: ToolPlan) -> None:
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self.tools = tools

    def _object(
        self, content: list[dict[str, Any]], gen: _MessageGeneration | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": gen.stop_reason if gen else None,
            "stop_sequence": gen.stop_sequence if gen else None,
        }

    def blocks(self, gen: _MessageGeneration) -> tuple[list[dict[str, Any]], bool]:
        """The reply's content blocks, and whether it calls tools."""
        if not self.tools.active:
            return [{"type": "text", "text": gen.text}], False
        content, calls = self.tools.finish(gen.text)
        return reply_blocks(content, calls), bool(calls)

    def complete(self, gen: _MessageGeneration) -> dict[str, Any]:
        blocks, calls = self.blocks(gen)
        body = self._object(blocks, gen)
        if calls:
            body.update(stop_reason="tool_use", stop_sequence=None)
        usage = {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens}
        return {**body, "usage": usage}

    def start(self, gen: _MessageGeneration) -> dict[str, Any]:
        usage = {"input_tokens": gen.prompt_tokens, "output_tokens": 0}
        return {"type": "message_start", "message": {**self._object([], None), "usage": usage}}

    @staticmethod
    def text_delta(text: str) -> dict[str, Any]:
        delta = {"type": "text_delta", "text": text}
        return {"type": "content_block_delta", "index": 0, "delta": delta}

    @staticmethod
    def end(gen: _MessageGeneration, calls: bool = False) -> dict[str, Any]:
        reason, sequence = ("tool_use", None) if calls else (gen.stop_reason, gen.stop_sequence)
        return {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": gen.completion_tokens},
        }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED_STATUS: "overloaded_error",
}


def anthropic_error(
    status: int, message: str, request_id: str | None = None, param: str | None = None
) -> tuple[int, dict[str, Any]]:
    """An error as Anthropic sends it: (status, body); a 503 is Anthropic's 529 overloaded.

    Anthropic's error has no ``param``: the message starts with the field at fault instead."""
    if param and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    if status == 503:
        status = OVERLOADED_STATUS
    kind = _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id:
        body["request_id"] = request_id
    return status, body


class _EventWriter(SseWriter):
    """Server-sent events with names, as Anthropic streams: ``event: <type>`` then the data."""

    @classmethod
    async def start(cls, request: web.Request, headers: dict[str, str]) -> _EventWriter:
        return cls((await cls.open(request, headers)).response)

    async def send(self, payload: dict[str, Any]) -> None:
        await self.named(payload["type"], payload)


# --- handlers ---


def _gone(request: web.Request) -> Callable[[], bool]:
    def gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    return gone


async def _messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = validate(MessagesRequest, await _read_json(request))
    check_model(state, body.model)
    plan = _tools(body)
    prompt, continued = await _prompt(state, body, plan)
    params = _sampling(state, body, len(prompt), plan)
    request_id = _log_of(request).request_id
    events = state.backend.generate(request_id, prompt, params)
    tokenizer = state.backend.tokenizer
    gen = _MessageGeneration(
        events, tokenizer, prompt, body.stop_sequences, _gone(request), continued
    )
    message = _Message(params.adapter or state.model_name, plan)
    try:
        await gen.start()  # admission: a refusal is a plain error response, even when streaming
        if body.stream:
            return await _stream(request, gen, message)
        pieces = gen.pieces()
        try:
            async for _ in pieces:
                pass
        finally:
            await pieces.aclose()
        return web.json_response(message.complete(gen), headers={"request-id": request_id})
    finally:
        await gen.close()
        _log_of(request).tokens = (len(prompt), gen.completion_tokens)


async def _stream(
    request: web.Request, gen: _MessageGeneration, message: _Message
) -> web.StreamResponse:
    request_id = _log_of(request).request_id
    sse = await _EventWriter.start(request, {"X-Request-Id": request_id, "request-id": request_id})
    try:
        await sse.send(message.start(gen))
        block = {"type": "text", "text": ""}
        await sse.send({"type": "content_block_start", "index": 0, "content_block": block})
        await sse.send({"type": "ping"})
        # With tools, text that may begin a call is held back; the calls go out at the end.
        hold = ContentHoldback(bool(message.tools.forced)) if message.tools.active else None
        pieces = gen.pieces()
        try:
            async for piece in pieces:
                text = hold.feed(piece.text) if hold is not None else piece.text
                if text:
                    await sse.send(message.text_delta(text))
        finally:
            await pieces.aclose()
        await sse.send({"type": "content_block_stop", "index": 0})
        blocks, calls = message.blocks(gen)
        for index, tool_use in enumerate((b for b in blocks if b["type"] == "tool_use"), 1):
            start = {**tool_use, "input": {}}
            await sse.send({"type": "content_block_start", "index": index, "content_block": start})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_use["input"])}
            await sse.send({"type": "content_block_delta", "index": index, "delta": delta})
            await sse.send({"type": "content_block_stop", "index": index})
        await sse.send(message.end(gen, calls))
        await sse.send({"type": "message_stop"})
        await sse.close()
    except ClientGone:
        _log_of(request).note = "client closed the stream"
    except Exception as exc:
        # The headers are gone already: the error is the stream's last event.
        error = from_backend_error(exc)
        if error.status >= 500 and not isinstance(exc, AdmissionRejected | BackendUnavailable):
            log.exception("%s stream failed", request_id)
        _log_of(request).note = f"stream ended by error: {error.message}"
        try:
            _, body = anthropic_error(error.status, error.message, request_id, error.param)
            await sse.send(body)
            await sse.close()
        except ClientGone:
            pass
    return sse.response


async def _count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = validate(CountTokensRequest, await _read_json(request))
    check_model(state, body.model)
    plan = _tools(body)
    prompt, _ = await _prompt(state, body, plan)
    request_id = _log_of(request).request_id
    return web.json_response({"input_tokens": len(prompt)}, headers={"request-id": request_id})


def _is_anthropic_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def _openai_error(response: web.StreamResponse) -> tuple[str, str | None] | None:
    """The message and param of an OpenAI-shaped error response; None for another response."""
    body = getattr(response, "body", None)
    if not isinstance(body, bytes):
        return None
    try:
        error = orjson.loads(body)["error"]
        message, param = error["message"], error.get("param")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(message, str):
        return None
    return message, param if isinstance(param, str) else None


@web.middleware
async def _anthropic_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Error responses under /v1/messages in Anthropic's shape.

    The app's own middleware, inside this one, turns every failure (auth, the in-flight cap,
    validation, the backend's errors, a bug) into an OpenAI-shaped error response with its
    status, headers and log line; this rewrites that response's body, so both APIs share one
    account of what failed."""
    response = await handler(request)
    if response.status < 400 or response.prepared or not _is_anthropic_path(request.path):
        return response
    error = _openai_error(response)
    if error is None:
        return response
    message, param = error
    request_id = response.headers.get("X-Request-Id")
    status, body = anthropic_error(response.status, message, request_id, param)
    headers = {
        name: value
        for name, value in response.headers.items()
        if name.lower() not in ("content-type", "content-length")
    }
    if request_id:
        headers["request-id"] = request_id
    return web.json_response(body, status=status, headers=headers)


def add_anthropic_routes(app: web.Application) -> None:
    """Serve the Anthropic Messages API on ``app``, an app from ``create_app`` not yet started:
    ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, under its api key, limits
    and request log, with errors there in Anthropic's shape."""
    if STATE not in app:
        raise ValueError("add_anthropic_routes needs an app built by create_app")
    app.middlewares.insert(0, _anthropic_errors)
    app.router.add_post(MESSAGES_PATH, _messages)
    app.router.add_post(COUNT_TOKENS_PATH, _count_tokens)
