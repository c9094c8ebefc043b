"""The OpenAI-compatible HTTP API over any ``GenerationBackend`` (coordinator or in-process).

``create_app`` builds an aiohttp application with /v1/chat/completions, /v1/completions,
/v1/models and /health. It holds no global state: everything lives on the app object.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mlxppd.core.log_text import escape
from mlxppd.core.protocol.sampling import GrammarSpec
from mlxppd.http.admin_api import AdminApi, add_admin_routes
from mlxppd.http.api_state import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_IN_FLIGHT,
    STATE,
    ApiState,
)
from mlxppd.http.chat_prompt import chat_prompt
from mlxppd.http.completion import ClientGone, Generation, Piece, TokenInfo, start_all
from mlxppd.http.errors import (
    ADMISSION_RETRY_AFTER_S,
    ApiError,
    error_response,
    from_backend_error,
    invalid,
)
from mlxppd.http.models_api import adapter_registry, check_model, get_model, list_models
from mlxppd.http.responses import Shape
from mlxppd.http.sse import SseWriter
from mlxppd.http.tools import ContentHoldback, ToolPlan, plan_tools
from mlxppd.http.validation import ParsedRequest, parse_chat, parse_completion, parse_json_body
from mlxppd.runtime.backends.contract import (
    AdmissionRejected,
    BackendUnavailable,
    GenerationBackend,
    RequestRefused,
    SamplingParams,
    SequenceFailed,
)
from mlxppd.runtime.observability.metrics import PipelineMetrics

log = logging.getLogger("mlxppd.http")

T = TypeVar("T")
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_TOKENS = 512
#: paths under the api key when one is set (/health answers everyone, in one word)
_KEYED_PREFIXES = ("/v1/", "/metrics", "/console/v1/")
FALLBACK_MAX_PROMPT_TOKENS = 32_768
#: how the seeds of a request's choices differ (an odd 64-bit constant: distinct for any n)
_SEED_STRIDE = 0x9E3779B97F4A7C15


@dataclass
class _RequestLog:
    """What the per-request log line reports, filled in by the handler."""

    request_id: str
    tokens: tuple[int, int] | None = None
    note: str | None = None


# aiohttp >= 3.13 wants typed request keys; older versions take a plain string.
_LOG: Any = (
    web.RequestKey("mlxpp_request_log", _RequestLog)
    if hasattr(web, "RequestKey")
    else "mlxpp_request_log"
)


def _log_of(request: web.Request) -> _RequestLog:
    info: _RequestLog = request[_LOG]
    return info


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
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    metrics_route: bool = True,
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
    ``body_timeout_s``: seconds a client has to send its body (408 after).
    """
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty; pass None to disable authentication")
    state = ApiState(
        backend=backend,
        model_name=alias or backend.model_id,
        api_key=api_key.encode() if api_key is not None else None,
        context_tokens=max_context_tokens,
        default_max_tokens=default_max_tokens,
        max_body_bytes=max_body_bytes,
        max_in_flight=max_in_flight,
        body_timeout_s=body_timeout_s,
        metrics=metrics,
    )
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_middleware])
    app[STATE] = state
    app.cleanup_ctx.append(_tokenizer_thread)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_get("/health", _health)
    if metrics is not None and metrics_route:
        app.router.add_get("/metrics", metrics_handler(metrics))
    if admin is not None:
        add_admin_routes(
            app, admin.controller, admin.verifier, on_auth_failure=admin.on_auth_failure
        )
    return app


def metrics_handler(
    metrics: PipelineMetrics,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handler


def create_metrics_app(metrics: PipelineMetrics) -> web.Application:
    """``GET /metrics`` alone, for ``--metrics-port``."""
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(metrics))
    return app


async def _tokenizer_thread(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxpp-tokenize")
    yield
    state.tokenize.shutdown(wait=False, cancel_futures=True)
    state.tokenize = None


async def _off_loop(state: ApiState, fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(state.tokenize, fn)


# --- middleware: request id, auth, errors, one log line per request ---


def _has_key(state: ApiState, request: web.Request) -> bool:
    """True when no key is set, or the request carries it: ``Authorization: Bearer <key>``, or
    ``x-api-key: <key>`` as Anthropic's clients send it."""
    if state.api_key is None:
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), state.api_key):
        return True
    key = request.headers.get("x-api-key", "").strip().encode()
    return hmac.compare_digest(key, state.api_key)


def _authorized(state: ApiState, request: web.Request) -> bool:
    # /admin routes check their own signatures; /health decides what it tells.
    return not request.path.startswith(_KEYED_PREFIXES) or _has_key(state, request)


def _check_headers(request: web.Request) -> None:
    # aiohttp hands undecodable header bytes over as lone surrogates; refuse them here, once.
    for name, value in request.headers.items():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ApiError(
                400, f"the {escape(name, 64)} header is not valid UTF-8", code="invalid_header"
            ) from None


@contextlib.contextmanager
def _counted(state: ApiState, request: web.Request) -> Iterator[None]:
    """One more request in flight, or a 503 when the cap is reached (only /v1 counts)."""
    if not request.path.startswith("/v1/"):
        yield
        return
    if state.in_flight >= state.max_in_flight:
        raise ApiError(
            503,
            f"the server is handling {state.in_flight} requests, its limit; retry shortly",
            type="server_overloaded",
            code="too_many_requests",
            headers={"Retry-After": str(ADMISSION_RETRY_AFTER_S)},
        )
    state.in_flight += 1
    try:
        yield
    finally:
        state.in_flight -= 1


@web.middleware
async def _middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = f"req-{uuid.uuid4().hex[:20]}"
    info = _RequestLog(request_id)
    request[_LOG] = info
    started = time.perf_counter()
    status = 500
    try:
        _check_headers(request)
        if not _authorized(state, request):
            raise ApiError(
                401,
                "missing or incorrect API key; send 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        with _counted(state, request):
            response = await handler(request)
        if not response.prepared:
            response.headers["X-Request-Id"] = request_id
        status = response.status
        return response
    except ApiError as exc:
        status = exc.status
        return error_response(exc, request_id)
    except (AdmissionRejected, BackendUnavailable, RequestRefused, SequenceFailed) as exc:
        error = from_backend_error(exc)
        status = error.status
        return error_response(error, request_id)
    except web.HTTPException as exc:  # unknown route, wrong method: same error shape
        status = exc.status
        error = ApiError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))
        return error_response(error, request_id)
    except ClientGone:
        status = 499  # nginx's "client closed request"; nothing reaches the client
        return web.Response(status=499)
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception:
        log.exception("%s %s %s failed", request_id, escape(request.method), escape(request.path))
        return error_response(from_backend_error(RuntimeError()), request_id)
    finally:
        tokens, note = info.tokens, info.note
        if state.metrics is not None:
            # The route pattern, not the raw path, keeps the label set small.
            resource = request.match_info.route.resource
            endpoint = resource.canonical if resource is not None else "other"
            state.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        log.info(
            "%s %s %s %d %.3fs%s%s",
            request_id,
            escape(request.method),
            escape(request.path),
            status,
            time.perf_counter() - started,
            f" prompt_tokens={tokens[0]} completion_tokens={tokens[1]}" if tokens else "",
            f" ({note})" if note else "",
        )


# --- models and health ---


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    health = state.backend.health()
    body: dict[str, Any] = {"status": "ok" if health.ready else "unavailable"}
    if _has_key(state, request):  # the stages' detail is for whoever holds the key
        body.update(model=state.model_name, detail=health.detail, stages=list(health.stages))
    return web.json_response(body, status=200 if health.ready else 503)


# --- completions ---


async def _read_json(request: web.Request) -> dict[str, Any]:
    state = request.app[STATE]
    try:
        async with asyncio.timeout(state.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {state.body_timeout_s:g} s",
            code="request_timeout",
        ) from None
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[STATE].max_body_bytes
        raise ApiError(
            413, f"the request body is larger than {limit} bytes", code="request_too_large"
        ) from None
    return parse_json_body(raw)


def _tokenizer(state: ApiState) -> Any:
    tokenizer = state.backend.tokenizer
    if tokenizer is None:
        raise BackendUnavailable("the model is still loading; retry shortly")
    return tokenizer


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    parsed = parse_chat(await _read_json(request))
    check_model(state, parsed.model)
    tokenizer = _tokenizer(state)
    if not (getattr(tokenizer, "has_chat_template", None) or tokenizer.chat_template):
        raise invalid("this model has no chat template; use /v1/completions", "messages")
    messages = [dict(m) for m in parsed.messages or ()]
    try:
        plan = plan_tools(parsed.tools, parsed.tool_choice)
    except ValueError as exc:
        raise invalid(str(exc), "tool_choice", "invalid_value") from None
    if plan.forced and parsed.grammar is not None:
        raise invalid("a forced tool call and a response_format cannot both hold", "tool_choice")
    try:
        prompt = await _off_loop(state, lambda: chat_prompt(tokenizer, messages, plan))
    except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
    return await _generate(request, state, parsed, prompt, chat=True, tools=plan)


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    parsed = parse_completion(await _read_json(request))
    check_model(state, parsed.model)
    tokenizer = _tokenizer(state)
    text_or_ids = parsed.prompt
    if isinstance(text_or_ids, str):
        text = text_or_ids
        prompt = await _off_loop(state, lambda: [int(t) for t in tokenizer.encode(text)])
    else:
        prompt = list(text_or_ids or [])
        vocab = len(tokenizer)
        if any(t >= vocab for t in prompt):
            raise invalid(f"token ids must be below the vocabulary size {vocab}", "prompt")
    return await _generate(request, state, parsed, prompt, chat=False)


def _max_tokens(state: ApiState, parsed: ParsedRequest, n_prompt: int, chat: bool) -> int:
    """The request's max_tokens after checking prompt and completion against the context."""
    param = "messages" if chat else "prompt"
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
        return parsed.max_tokens or state.default_max_tokens
    if n_prompt >= context:
        raise invalid(
            f"this model's maximum context length is {context} tokens, but the prompt has "
            f"{n_prompt}",
            param,
            "context_length_exceeded",
        )
    if parsed.max_tokens is None:
        return min(state.default_max_tokens, context - n_prompt)
    if n_prompt + parsed.max_tokens > context:
        raise invalid(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{n_prompt} and max_tokens asks for {parsed.max_tokens} more",
            "max_tokens",
            "context_length_exceeded",
        )
    return parsed.max_tokens


def _choice_params(
    state: ApiState, parsed: ParsedRequest, max_tokens: int, tools: ToolPlan | None = None
) -> list[SamplingParams]:
    """One SamplingParams per choice: the request's, each choice with its own seed (choice 0
    keeps the request's, so n=1 draws what it always drew). The request's ``model`` picks a
    per-request adapter when it names one; any other name is the base model."""
    registry = adapter_registry(state.backend)
    try:
        adapter = registry.chosen(parsed.model) if registry is not None else None
    except RequestRefused as exc:
        raise ApiError(409, str(exc), param="model", code="adapter_unloading") from None
    if adapter is None:
        check_model(state, parsed.model)  # an adapter unloaded since: 404, not the base model
    base = SamplingParams(
        adapter=adapter,
        max_tokens=max_tokens,
        temperature=parsed.temperature,
        top_p=parsed.top_p,
        seed=parsed.seed,
        logprobs=parsed.logprobs,
        top_k=parsed.top_k,
        min_p=parsed.min_p,
        repetition_penalty=parsed.repetition_penalty,
        presence_penalty=parsed.presence_penalty,
        frequency_penalty=parsed.frequency_penalty,
        logit_bias=parsed.logit_bias,
        top_logprobs=parsed.top_logprobs,
        grammar=_grammar(parsed, tools or ToolPlan()),
    )
    if parsed.seed is None:
        return [base] * parsed.n
    return [
        replace(base, seed=(parsed.seed + i * _SEED_STRIDE) % (1 << 64)) for i in range(parsed.n)
    ]


def _grammar(parsed: ParsedRequest, tools: ToolPlan) -> GrammarSpec | None:
    """The output's grammar: a forced tool call's, or the response_format's."""
    if (schema := tools.call_grammar()) is not None:
        return GrammarSpec(kind="json_schema", schema_text=json.dumps(schema))
    return parsed.grammar


async def _generate(
    request: web.Request, state: ApiState, parsed: ParsedRequest, prompt: list[int], *,
    chat: bool, tools: ToolPlan | None = None,
) -> web.StreamResponse:  # fmt: skip
    tools = tools or ToolPlan()
    params = _choice_params(state, parsed, _max_tokens(state, parsed, len(prompt), chat), tools)

    def gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    request_id = _log_of(request).request_id
    streams = state.backend.generate_choices(request_id, prompt, params)
    tokenizer = state.backend.tokenizer
    gens = [Generation(s, tokenizer, len(prompt), parsed.stop, is_gone=gone) for s in streams]
    shape = Shape(chat, params[0].adapter or state.model_name, parsed.logprobs, tools)
    try:
        # Together: the choices of one prompt share its prefill, so they start as one.
        await start_all(gens)
        if parsed.stream:
            return await _stream(request, gens, shape, parsed.include_usage)
        results = await asyncio.gather(*(_collect(gen) for gen in gens))
        return web.json_response(shape.complete(list(zip(gens, results, strict=True))))
    finally:
        for gen in gens:
            await gen.close()
        completion = sum(gen.completion_tokens for gen in gens)
        _log_of(request).tokens = (len(prompt), completion)


async def _collect(gen: Generation) -> list[TokenInfo]:
    pieces = gen.pieces()
    tokens: list[TokenInfo] = []
    try:
        async for piece in pieces:
            tokens.extend(piece.tokens)
    finally:
        await pieces.aclose()
    return tokens


async def _pieces_of(
    index: int, gen: Generation, out: asyncio.Queue[tuple[int, Piece | BaseException | None]]
) -> None:
    """Feed one choice's pieces into the stream's queue; None ends it, an error ends it too."""
    pieces = gen.pieces()
    try:
        async for piece in pieces:
            if piece.text or piece.tokens:
                await out.put((index, piece))
        await out.put((index, None))
    except Exception as exc:
        await out.put((index, exc))
    finally:
        await pieces.aclose()


async def _stream(
    request: web.Request, gens: list[Generation], shape: Shape, include_usage: bool
) -> web.StreamResponse:
    sse = await SseWriter.open(request, {"X-Request-Id": _log_of(request).request_id})
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()
    feeders = [asyncio.ensure_future(_pieces_of(i, gen, queue)) for i, gen in enumerate(gens)]
    # With tools, text that may begin a call is held back; the calls go out at the end.
    forced = bool(shape.tools.forced)
    holds = [ContentHoldback(forced) if shape.tools.active else None for _ in gens]
    try:
        for index in range(len(gens)):
            if chat_start := shape.role_chunk(include_usage, index):
                await sse.event(chat_start)
        running = len(gens)
        while running:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
                reason = gens[index].finish_reason
                if holds[index] is not None:
                    calls, reason = shape.calls_chunk(gens[index], include_usage, index)
                    if calls is not None:
                        await sse.event(calls)
                finish = Piece("")
                await sse.event(shape.chunk(finish, reason, include_usage, index))
                continue
            hold = holds[index]
            if hold is not None:
                item = Piece(hold.feed(item.text), item.tokens)
            await sse.event(shape.chunk(item, None, include_usage, index))
        if include_usage:
            await sse.event(shape.usage_chunk(gens))
        await sse.done()
    except ClientGone:
        _log_of(request).note = "client closed the stream"
    except Exception as exc:
        # Headers are gone already: the error becomes the stream's last event, so the client
        # sees a failure rather than a silent end.
        error = from_backend_error(exc)
        if error.status >= 500 and not isinstance(exc, AdmissionRejected | BackendUnavailable):
            log.exception("%s stream failed", _log_of(request).request_id)
        _log_of(request).note = f"stream ended by error: {error.message}"
        try:
            await sse.event(error.body())
            await sse.close()
        except ClientGone:
            pass
    finally:
        for feeder in feeders:
            feeder.cancel()
        await asyncio.gather(*feeders, return_exceptions=True)
    return sse.response
