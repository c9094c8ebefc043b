"""The OpenAI-compatible API over any ``GenerationBackend`` (coordinator or in-process).

``create_app`` builds the base app (``http/base_app.py``: middleware, limits, /health,
/metrics) with the OpenAI routes on it: /v1/chat/completions, /v1/completions and /v1/models
(and the signed admin API when given one). It holds no global state: everything lives on the
app object.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from mlxppd.core.fair_share import DEFAULT_MAX_CHOICES_PER_REQUEST, per_client
from mlxppd.core.kv_admission import DEFAULT_STAGE_SEQUENCES
from mlxppd.http.admin_api import AdminApi, add_admin_routes
from mlxppd.http.api_state import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_STREAM_BUFFER_EVENTS,
    DEFAULT_STREAM_SEND_BUFFER_BYTES,
    DEFAULT_STREAM_STALL_S,
    STATE,
    ApiState,
)
from mlxppd.http.base_app import (
    admit_sequences,
    base_app,
    body_bytes,
    client_gone,
    read_json,
    request_log,
)
from mlxppd.http.chat_prompt import chat_prompt, has_chat_template
from mlxppd.http.completion import Generation, Piece, start_all
from mlxppd.http.cors import CorsPolicy, enable_cors
from mlxppd.http.errors import ApiError, invalid
from mlxppd.http.generation import choice_params, prompt_context
from mlxppd.http.models_api import check_model, get_model, list_models
from mlxppd.http.prompt_bound import bounded_tokens
from mlxppd.http.responses import Shape
from mlxppd.http.sequence_gate import SequenceGate
from mlxppd.http.sse import SseWriter, StreamFeed, failures_end_stream
from mlxppd.http.tools import ToolPlan, plan_tools
from mlxppd.http.validation import ParsedRequest, parse_chat, parse_completion
from mlxppd.runtime.backends.contract import GenerationBackend
from mlxppd.runtime.observability.metrics import PipelineMetrics

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_TOKENS = 512


def create_app(
    backend: GenerationBackend,
    *,
    api_key: str | None = None,
    alias: str | None = None,
    max_context_tokens: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics: PipelineMetrics | None = None,
    admin: AdminApi | None = None,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    stream_buffer_events: int = DEFAULT_STREAM_BUFFER_EVENTS,
    stream_stall_s: float = DEFAULT_STREAM_STALL_S,
    stream_send_buffer_bytes: int = DEFAULT_STREAM_SEND_BUFFER_BYTES,
    metrics_route: bool = True,
    cors_origins: Sequence[str] = (),
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST,
    max_sequences: int | None = DEFAULT_STAGE_SEQUENCES,
) -> web.Application:
    """The OpenAI API app.

    ``api_key``: when set, /v1/* and /metrics need ``Authorization: Bearer <key>``; /health
    answers anyone with its status word, and only a caller with the key gets the detail.
    ``alias``: the model name clients see (default ``backend.model_id``).
    ``max_context_tokens``: prompt + max_tokens limit (default: the tokenizer's
    ``model_max_length`` when it is a real number, else prompts are capped at 32768 tokens).
    ``default_max_tokens``: chat completions without max_tokens (completions default to 16).
    ``metrics``: count requests into it; ``metrics_route``: serve ``GET /metrics`` from it.
    ``admin``: also serve the signed admin API under /admin/v1 (see admin_api.py); the api key
    does not apply there, and an admin signature opens nothing under /v1.
    ``max_in_flight``: requests handled at once (503 with Retry-After beyond).
    ``max_choices_per_request``: the most choices (``n``) a request may ask for (a 400 beyond).
    ``max_sequences``: sequences (every choice counts) generated at once, shared fairly between
    clients when they are all taken (``http/sequence_gate.py``; None: no cap but the stages').
    ``stream_buffer_events``: events a stream holds for a client reading slower than the model
    writes; a buffer full for ``stream_stall_s`` seconds means the client has stopped reading,
    and the stream is cut (``http/sse.py``).
    ``stream_send_buffer_bytes``: the kernel send buffer of a stream's socket.
    ``cors_origins``: the origins (``scheme://host[:port]``; ``*``: every one, refused with an
    api key) whose web pages may call the API paths from a browser (``http/cors.py``); none by
    default. A ValueError names a malformed origin.
    The deadlines (head, body, write, idle) are the listener's: ``app/http_site.py``.
    """
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty; pass None to disable authentication")
    if max_choices_per_request < 1:
        raise ValueError(
            f"max_choices_per_request must be 1 or more, not {max_choices_per_request}"
        )
    if max_sequences is not None and per_client(max_sequences) < max_choices_per_request:
        raise ValueError(
            f"max_choices_per_request ({max_choices_per_request}) must be at most the "
            f"{per_client(max_sequences)} sequences one client may hold of max_sequences "
            f"({max_sequences}): a request of that many choices could never run"
        )
    state = ApiState(
        backend=backend,
        model_name=alias or backend.model_id,
        api_key=api_key.encode() if api_key is not None else None,
        context_tokens=max_context_tokens,
        default_max_tokens=default_max_tokens,
        max_body_bytes=max_body_bytes,
        max_in_flight=max_in_flight,
        stream_buffer_events=stream_buffer_events,
        stream_stall_s=stream_stall_s,
        stream_send_buffer_bytes=stream_send_buffer_bytes,
        metrics=metrics,
        max_choices_per_request=max_choices_per_request,
        sequences=SequenceGate(max_sequences, metrics=metrics) if max_sequences else None,
    )
    app = base_app(state, metrics_route=metrics_route)
    enable_cors(app, CorsPolicy.of(cors_origins, has_api_key=api_key is not None))
    add_openai_routes(app)
    if admin is not None:
        add_admin_routes(
            app, admin.controller, admin.verifier, on_auth_failure=admin.on_auth_failure
        )
    return app


def add_openai_routes(app: web.Application) -> None:
    """The OpenAI API's routes on ``app``, an app from ``base_app`` not yet started (its errors
    keep the base app's default, OpenAI's shape)."""
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)


# --- completions ---


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    parsed = parse_chat(await read_json(request))
    check_model(state, parsed.model)
    tokenizer = state.loaded_tokenizer()
    if not has_chat_template(tokenizer):
        raise invalid("this model has no chat template; use /v1/completions", "messages")
    messages = [dict(m) for m in parsed.messages or ()]
    try:
        plan = plan_tools(parsed.tools, parsed.tool_choice)
    except ValueError as exc:
        raise invalid(str(exc), "tool_choice", "invalid_value") from None
    if plan.forced and parsed.grammar is not None:
        raise invalid("a forced tool call and a response_format cannot both hold", "tool_choice")
    context = prompt_context(state)
    try:
        prompt = await state.off_loop(
            lambda: chat_prompt(tokenizer, messages, plan, context), size=body_bytes(request)
        )
    except ApiError:
        raise  # too long for the context, found before tokenizing
    except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
    return await _generate(request, state, parsed, prompt, chat=True, tools=plan)


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    parsed = parse_completion(await read_json(request))
    check_model(state, parsed.model)
    tokenizer = state.loaded_tokenizer()
    text_or_ids = parsed.prompt
    if isinstance(text_or_ids, str):
        text, context = text_or_ids, prompt_context(state)
        prompt = await state.off_loop(
            lambda: bounded_tokens(tokenizer, text, context, "prompt"), size=len(text)
        )
    else:
        prompt = list(text_or_ids or [])
        vocab = len(tokenizer)
        if any(t >= vocab for t in prompt):
            raise invalid(f"token ids must be below the vocabulary size {vocab}", "prompt")
    return await _generate(request, state, parsed, prompt, chat=False)


async def _generate(
    request: web.Request, state: ApiState, parsed: ParsedRequest, prompt: list[int], *,
    chat: bool, tools: ToolPlan | None = None,
) -> web.StreamResponse:  # fmt: skip
    tools = tools or ToolPlan()
    params = choice_params(state, parsed, len(prompt), "messages" if chat else "prompt", tools)
    await admit_sequences(request, len(params))
    log_line = request_log(request)
    streams = state.backend.generate_choices(log_line.request_id, prompt, params)
    tokenizer = state.backend.tokenizer
    gone = client_gone(request)
    gens = [Generation(s, tokenizer, len(prompt), parsed.stop, is_gone=gone) for s in streams]
    shape = Shape(chat, params[0].adapter or state.model_name, parsed.logprobs, tools)
    try:
        # Together: the choices of one prompt share its prefill, so they start as one.
        await start_all(gens)
        if parsed.stream:
            return await _stream(request, gens, shape, parsed.include_usage)
        results = await asyncio.gather(*(gen.collect() for gen in gens))
        return web.json_response(shape.complete(list(zip(gens, results, strict=True))))
    finally:
        for gen in gens:
            await gen.close()
        completion = sum(gen.completion_tokens for gen in gens)
        log_line.tokens = (len(prompt), completion)


async def _nonempty(gen: Generation) -> AsyncIterator[Piece]:
    """One choice's pieces that carry text or tokens (an empty one is no chunk)."""
    pieces = gen.pieces()
    try:
        async for piece in pieces:
            if piece.text or piece.tokens:
                yield piece
    finally:
        await pieces.aclose()


async def _stream(
    request: web.Request, gens: list[Generation], shape: Shape, include_usage: bool
) -> web.StreamResponse:
    sse = await SseWriter.open(request, {"X-Request-Id": request_log(request).request_id})

    async def send_error(error: ApiError) -> None:
        await sse.event(error.body())
        await sse.close()

    async with failures_end_stream(request, send_error):
        async with StreamFeed(request, [_nonempty(gen) for gen in gens]) as feed:
            await _send_choices(sse, feed, gens, shape, include_usage)
    return sse.response


async def _send_choices(
    sse: SseWriter, feed: StreamFeed[Piece], gens: list[Generation], shape: Shape,
    include_usage: bool,
) -> None:  # fmt: skip
    """Every choice's chunks as the feed hands them over, then the usage and [DONE]."""
    # With tools, text that may begin a call is held back; the calls go out at the end.
    holds = [shape.tools.holdback() for _ in gens]
    for index in range(len(gens)):
        if chat_start := shape.role_chunk(include_usage, index):
            await sse.event(chat_start)
    async for index, item in feed:
        if item is None:
            reason = gens[index].finish_reason
            if holds[index] is not None:
                calls, reason = shape.calls_chunk(gens[index], include_usage, index)
                if calls is not None:
                    await sse.event(calls)
            await sse.event(shape.chunk(Piece(""), reason, include_usage, index))
            continue
        hold = holds[index]
        if hold is not None:
            item = Piece(hold.feed(item.text), item.tokens)
            if not item.text and not shape.logprobs:
                continue  # all held back (a call being written): no empty delta
        await sse.event(shape.chunk(item, None, include_usage, index))
    if include_usage:
        await sse.event(shape.usage_chunk(gens))
    await sse.done()
