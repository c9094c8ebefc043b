"""The base of the HTTP app, which every API on it shares.

``base_app(state)`` is an aiohttp application with one middleware (request id, header check,
api key, in-flight cap, metrics, one log line per request, and every failure rendered in the
error shape of the API whose path was asked: ``serve_errors_as``), ``/health`` and
``/metrics``. The APIs add their routes to it: ``http/openai_api.py``, ``http/anthropic_api.py``,
the admin API and the console. Handlers read bodies with ``read_json`` (the size limit here, the
time limit the listener's: ``app/http_site.py``) and report into their request's log line
through ``request_log``. Without an API key, what a key would guard answers only requests a web
page elsewhere cannot make (``http/same_origin.py``), but for the origins CORS lists
(``http/cors.py``, whose preflights the middleware answers before asking for the key). A
client gone mid-request (a reset) is one quiet line, its request's, and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mlxppd.core.log_text import escape
from mlxppd.http.api_state import BULK_THREAD, STATE, ApiState
from mlxppd.http.completion import ClientGone
from mlxppd.http.cors import answer_preflight, origin_admitted
from mlxppd.http.errors import (
    ADMISSION_RETRY_AFTER_S,
    ApiError,
    ErrorShape,
    from_backend_error,
)
from mlxppd.http.same_origin import check_same_origin
from mlxppd.http.sequence_gate import Held, client_of
from mlxppd.http.unserved import not_found
from mlxppd.http.validation import parse_json_body
from mlxppd.runtime.backends.contract import (
    AdmissionRejected,
    BackendUnavailable,
    RequestRefused,
    SequenceFailed,
)
from mlxppd.runtime.observability.metrics import PipelineMetrics

log = logging.getLogger("mlxppd.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: paths under the api key when one is set (/health answers everyone, in one word)
_KEYED_PREFIXES = ("/v1/", "/api/", "/metrics", "/console/v1/")


@dataclass
class RequestLog:
    """What the per-request log line reports, filled in by the handler."""

    request_id: str
    #: (prompt tokens, completion tokens)
    tokens: tuple[int, int] | None = None
    note: str | None = None


# aiohttp >= 3.13 wants typed request keys; older versions take a plain string.
_LOG: Any = (
    web.RequestKey("mlxpp_request_log", RequestLog)
    if hasattr(web, "RequestKey")
    else "mlxpp_request_log"
)
_BODY_BYTES: Any = (
    web.RequestKey("mlxpp_body_bytes", int) if hasattr(web, "RequestKey") else "mlxpp_body_bytes"
)
_HELD: Any = (
    web.RequestKey("mlxpp_sequences_held", list) if hasattr(web, "RequestKey") else "mlxpp_held"
)


class BodyDeadline(TimeoutError):
    """The request's body did not arrive within the listener's body deadline (raised into a
    handler reading it by ``app/http_site.py``; the middleware answers it with a 408)."""


def request_log(request: web.Request) -> RequestLog:
    """The request's log line (its id, and what the handler adds to the line)."""
    info: RequestLog = request[_LOG]
    return info


def client_gone(request: web.Request) -> Callable[[], bool]:
    """Whether the client has closed the request's connection (a generation stops then)."""

    def gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    return gone


def body_bytes(request: web.Request) -> int:
    """The size of the body ``read_json`` read (0 before), which picks the tokenizer's lane."""
    size: int = request.get(_BODY_BYTES, 0)
    return size


async def admit_sequences(request: web.Request, count: int) -> None:
    """The request creates ``count`` sequences: held against the server's cap, per client fair
    share, until the request ends (``http/sequence_gate.py``); an ApiError when refused."""
    state = request.app[STATE]
    if state.sequences is None:
        return
    held = await state.sequences.admit(client_of(request), count)
    request.setdefault(_HELD, []).append(held)


def cut_counter(app: web.Application) -> Callable[[str], None] | None:
    """Where the connections cut on ``app``'s clients are counted, by reason: its metrics'
    ``mlxpp_http_connections_cut`` (None when it has no metrics)."""
    return _by_reason(app, "http_cut")


def rejected_counter(app: web.Application) -> Callable[[str], None] | None:
    """Where the requests aiohttp refuses on ``app``'s listeners are counted, by reason: its
    metrics' ``mlxpp_http_rejected`` (None when it has no metrics)."""
    return _by_reason(app, "http_rejected")


def _by_reason(app: web.Application, family: str) -> Callable[[str], None] | None:
    metrics = app[STATE].metrics if STATE in app else None
    if metrics is None:
        return None
    counter = getattr(metrics, family)

    def count(reason: str) -> None:
        counter.labels(reason=reason).inc()

    return count


def note_listener(app: web.Application, host: str) -> None:
    """The listener serving ``app`` is bound to ``host``: a Host header may name it."""
    if STATE in app:
        app[STATE].listen_hosts.add(host.lower())


def base_app(state: ApiState, *, metrics_route: bool = True) -> web.Application:
    """The app every API is added to: ``state``'s limits and key, /health, and ``GET /metrics``
    when ``state`` counts into metrics and ``metrics_route`` is set."""
    app = web.Application(client_max_size=state.max_body_bytes, middlewares=[_middleware])
    app[STATE] = state
    app.cleanup_ctx.append(_tokenizer_thread)
    app.router.add_get("/health", _health)
    if state.metrics is not None and metrics_route:
        app.router.add_get("/metrics", metrics_handler(state.metrics))
    return app


def serve_errors_as(app: web.Application, root: str, shape: ErrorShape) -> None:
    """Render every error under ``root`` (that path and below it) in ``shape``: the API served
    there answers in its own words, whatever failed (auth, limits, its handler, a bug)."""
    if STATE not in app:
        raise ValueError("serve_errors_as needs an app built by base_app")
    app[STATE].error_shapes[root] = shape


def metrics_handler(metrics: PipelineMetrics) -> Handler:
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
    state.tokenize_bulk = ThreadPoolExecutor(max_workers=1, thread_name_prefix=BULK_THREAD)
    yield
    for lane in (state.tokenize, state.tokenize_bulk):
        lane.shutdown(wait=False, cancel_futures=True)
    state.tokenize = state.tokenize_bulk = None


async def read_bounded(request: web.Request, limit: int, what: str) -> bytes:
    """The request's body, a 413 naming ``what`` past ``limit`` bytes (refused on its
    Content-Length before a byte is read when it says so); the listener's body deadline
    applies (``BodyDeadline``)."""
    too_large = ApiError(413, f"{what} is at most {limit} bytes", code="request_too_large")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object, within the app's size limit and the listener's
    body deadline (``BodyDeadline``: a 408)."""
    state = request.app[STATE]
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = state.max_body_bytes
        raise ApiError(
            413, f"the request body is larger than {limit} bytes", code="request_too_large"
        ) from None
    request[_BODY_BYTES] = len(raw)
    return parse_json_body(raw)


# --- middleware: request id, auth, limits, errors, one log line per request ---


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
    """One more request in flight, or a 503 when the cap is reached (only /v1 and Ollama's
    /api count); the sequences the request held (``admit_sequences``) freed when it ends."""
    try:
        if not request.path.startswith(("/v1/", "/api/")):
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
    finally:
        held: list[Held] = request.pop(_HELD, [])
        if state.sequences is not None:
            for sequences in held:
                state.sequences.release(sequences)


async def _answer(
    state: ApiState, request: web.Request, handler: Handler, request_id: str
) -> web.StreamResponse:
    """The handler's response, or its failure as an error in the shape of the path's API."""
    try:
        _check_headers(request)
        if (preflight := answer_preflight(request)) is not None:
            return preflight  # before the key: a browser sends none on a CORS preflight
        if not _authorized(state, request):
            raise ApiError(
                401,
                "missing or incorrect API key; send 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if state.api_key is None and request.path.startswith(_KEYED_PREFIXES):
            admitted = origin_admitted(request)  # an origin CORS lists passes the Origin check
            check_same_origin(request, state.listen_hosts, origin_admitted=admitted)
        with _counted(state, request):
            response = await handler(request)
        if not response.prepared:
            response.headers["X-Request-Id"] = request_id
        return response
    except (ApiError, AdmissionRejected, BackendUnavailable, RequestRefused, SequenceFailed) as exc:
        error = from_backend_error(exc)
    except BodyDeadline as exc:
        error = ApiError(408, str(exc), code="request_timeout")
    except web.HTTPNotFound:  # what is served, said in the path's API shape
        error = not_found(request)
    except web.HTTPException as exc:  # wrong method and the like: the same error shape
        error = ApiError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))
    except ClientGone:
        return web.Response(status=499)  # nginx's "client closed request"; nothing reaches it
    except ConnectionError:
        if client_gone(request)():
            # The client reset the connection mid-request: its request's line says so, once.
            request_log(request).note = "the client reset the connection"
            if (count := cut_counter(request.app)) is not None:
                count("client_reset")
            return web.Response(status=499)
        log.exception("%s %s %s failed", request_id, escape(request.method), escape(request.path))
        error = from_backend_error(RuntimeError())
    except Exception:
        log.exception("%s %s %s failed", request_id, escape(request.method), escape(request.path))
        error = from_backend_error(RuntimeError())
    return state.error_shape(request.path).response(error, request_id)


def _account(
    state: ApiState, request: web.Request, info: RequestLog, status: int, seconds: float
) -> None:
    """The request's count in the metrics and its one log line."""
    if state.metrics is not None:
        # The route pattern, not the raw path, keeps the label set small.
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "other"
        state.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
    tokens, note = info.tokens, info.note
    log.info(
        "%s %s %s %d %.3fs%s%s",
        info.request_id,
        escape(request.method),
        escape(request.path),
        status,
        seconds,
        f" prompt_tokens={tokens[0]} completion_tokens={tokens[1]}" if tokens else "",
        f" ({note})" if note else "",
    )


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    info = RequestLog(f"req-{uuid.uuid4().hex[:20]}")
    request[_LOG] = info
    started = time.perf_counter()
    status = 500
    try:
        response = await _answer(state, request, handler, info.request_id)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499
        raise
    finally:
        _account(state, request, info, status, time.perf_counter() - started)


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    health = state.backend.health()
    body: dict[str, Any] = {"status": "ok" if health.ready else "unavailable"}
    if _has_key(state, request):  # the stages' detail is for whoever holds the key
        body.update(model=state.model_name, detail=health.detail, stages=list(health.stages))
    return web.json_response(body, status=200 if health.ready else 503)
