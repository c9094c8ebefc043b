"""The coordinator's admin API: cluster status, drain and resume, behind signed requests.

Every route checks a signature (``mlxppd.wire.admin_auth``): an operator's ``MLXPP-ED25519``
one when the cluster TOML lists ``[operators]``, else (legacy mode, warned of at start) an
``MLXPP-HMAC`` made with a key derived from the cluster secret; either is bound to the
cluster's name and to a ``Host`` header that names this server. The OpenAI API key plays no
part here, and an admin signature opens nothing under /v1. What the header alone shows
(present, well formed, fresh, of the scheme in force) is checked before a byte of the body is
read; the body (at most ``MAX_ADMIN_BODY_BYTES``, within the listener's body deadline) is read
only to verify the signature, which covers its digest. Only two routes are unsigned:
``GET /admin/v1/challenge`` says which cluster name to sign for, and
``GET /admin/v1/openapi.json`` is the routes' OpenAPI document (``admin_openapi.py``). The
runtime supplies an ``AdminController``; the status document it returns is the frozen model of
``mlxppd/core/status_document.py``, served as its JSON; docs/admin-api.md is the reference for
the routes and the status document.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from pydantic import ValidationError

from mlxppd.core.agent.health import overall_health
from mlxppd.core.log_text import escape
from mlxppd.core.log_throttle import LogThrottle
from mlxppd.core.status_document import ClusterStatus, RepartitionEvents, StatusDocument
from mlxppd.http.admin_models import (
    ADAPTERS_PATH,
    ADAPTERS_UNLOAD_PATH,
    ADMIN_OPENAPI_PATH,
    ADMIN_PREFIX,
    CHALLENGE_PATH,
    DRAIN_PATH,
    EVENTS_PATH,
    PREPARE_PATH,
    REPARTITION_PATH,
    RESUME_PATH,
    STATUS_PATH,
    AdapterLoadRequest,
    AdapterUnloadRequest,
    PrepareRequest,
    RepartitionRequest,
)
from mlxppd.http.admin_openapi import admin_openapi_text
from mlxppd.http.base_app import read_bounded
from mlxppd.http.errors import ApiError, error_response
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.system.host_addresses import is_local_address
from mlxppd.wire.admin_auth import (
    AdminAuthError,
    AdminVerifier,
    admin_key,
    challenge,
    host_names_this_server,
)
from mlxppd.wire.operator_key import OPERATOR_KEY_FLAG, OPERATORS_KEY, Operators, operators_of

__all__ = [
    "ADAPTERS_PATH",
    "ADAPTERS_UNLOAD_PATH",
    "ADMIN_OPENAPI_PATH",
    "ADMIN_PREFIX",
    "CHALLENGE_PATH",
    "DRAIN_PATH",
    "EVENTS_PATH",
    "MAX_ADMIN_BODY_BYTES",
    "PREPARE_PATH",
    "REPARTITION_PATH",
    "RESUME_PATH",
    "STATUS_PATH",
    "AdapterLoadRequest",
    "AdapterUnloadRequest",
    "AdminApi",
    "AdminController",
    "PrepareRequest",
    "RepartitionRequest",
    "add_admin_routes",
    "status_document",
]

log = logging.getLogger("mlxppd.http.admin")

#: admin requests carry no real payload; refuse anything bigger before hashing it
MAX_ADMIN_BODY_BYTES = 64 * 1024

_MESSAGES = {
    "missing": "this admin route needs a signed 'Authorization' header (use mlxppctl)",
    "malformed": "the admin signature header is malformed",
    "stale": "the admin signature's timestamp is outside the accepted window; "
    "check that the clocks of client and coordinator agree",
    "bad_mac": "the admin signature does not verify; check that the client uses this "
    "cluster's secret",
    "bad_signature": f"the operator signature does not verify; check that {OPERATORS_KEY} in "
    "this cluster's TOML lists the operator's name with the public key of the key used",
    "operator_key_required": f"this cluster lists {OPERATORS_KEY}, so admin requests must be "
    f"signed with an operator key, not the cluster secret: use `mlxppctl {OPERATOR_KEY_FLAG} "
    "PATH` (or paste the key file's line into the web console)",
    "replayed": "this admin request was already seen; sign every request afresh",
    "wrong_host": "the signed Host header does not name this server (its address and port); "
    "send the request to the address it was signed for, without a proxy or port forward that "
    "changes the port",
}


class AdminController(Protocol):
    """What the admin routes drive; the coordinator's runtime implements it."""

    async def status(self) -> ClusterStatus:
        """The status document (docs/admin-api.md), without "health" and "detail"."""
        ...

    async def drain(self) -> dict[str, Any]:
        """Stop admitting requests; e.g. ``{"admission": "draining", "in_flight": 3}``."""
        ...

    async def resume(self) -> dict[str, Any]:
        """Admit requests again; e.g. ``{"admission": "open"}``."""
        ...

    async def repartition(
        self, stage_memory: list[int | None] | None, pp_layers: str | None
    ) -> dict[str, Any]:
        """An explicit elastic trigger: ``{"accepted": true, "seq": n}`` or
        ``{"accepted": false, "reason": ..., "message": ...}``."""
        ...

    async def events(self, after: int) -> RepartitionEvents:
        """The elastic state and the repartition events numbered above ``after``."""
        ...

    async def prepare(
        self, max_rate_bytes_s: float | None, nodes: list[str] | None
    ) -> dict[str, Any]:
        """Ship stage nodes what their layers need: ``{"accepted": true, "nodes": [...]}`` or
        ``{"accepted": false, "reason": ..., "message": ...}``; progress is in the status."""
        ...

    async def adapter_load(self, name: str, path: str) -> dict[str, Any]:
        """Hold a per-request adapter on every stage: ``{"accepted": true, ...}`` once
        requests may choose it, or ``{"accepted": false, "reason": ..., "message": ...}``."""
        ...

    async def adapter_unload(self, name: str, drain_timeout_s: float) -> dict[str, Any]:
        """Drain one adapter's requests, then drop it on every stage."""
        ...


@dataclass(frozen=True)
class AdminApi:
    """The admin routes' parts, as ``create_app(..., admin=AdminApi(...))`` takes them.

    ``on_auth_failure(reason)`` is called once per refused request (count it in a metric).
    """

    controller: AdminController
    verifier: AdminVerifier
    on_auth_failure: Callable[[str], None] | None = None


LEGACY_WARNING = (
    f"the cluster TOML lists no {OPERATORS_KEY}, so the admin API takes signatures made with "
    "the cluster secret, which every stage host holds: any of them can drain or repartition "
    "the cluster; run `mlxppctl operator-key new PATH --name NAME` on each operator's machine "
    f"and list the line it prints under {OPERATORS_KEY} (docs/admin-api.md)"
)


def signed_admin_api(
    controller: AdminController,
    secret_key: bytes,
    metrics: PipelineMetrics | None,
    cluster_name: str | Callable[[], str],
    operators: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
    *,
    warn_legacy: bool = True,
) -> AdminApi:
    """The admin API of a coordinator for ``cluster_name``: requests signed by one of
    ``operators`` (the cluster TOML's ``[operators]`` table; a callable follows reloads), or,
    while it is empty, with the key derived from the cluster secret (the raw secret stays with
    the caller); refusals counted when metrics are on. Legacy mode is warned of here, once
    (``warn_legacy``: False where no other host holds the secret, a loopback cluster)."""

    def count_auth_failure(reason: str) -> None:
        if metrics is not None:
            metrics.admin_auth_failures.labels(reason=reason).inc()

    def listed() -> Operators:
        table = operators() if callable(operators) else operators
        return operators_of(table or {})

    if warn_legacy and not len(listed()):
        log.warning("%s", LEGACY_WARNING)
    verifier = AdminVerifier(
        admin_key(secret_key), cluster_name=cluster_name, clock=time.time, operators=listed
    )
    return AdminApi(controller, verifier, count_auth_failure)


def status_document(status: ClusterStatus) -> StatusDocument:
    """``status`` with its health badge and the reason for it (``core/agent/health.py``)."""
    badge, detail = overall_health(status.model_dump(mode="json"))
    return StatusDocument.model_validate({**dict(status), "health": badge, "detail": detail})


@functools.lru_cache(maxsize=128)
def _is_local(name: str) -> bool:
    # A name may need DNS; only signed requests get here, and the answer is kept.
    return is_local_address(name)


async def _names_this_server(request: web.Request) -> bool:
    """Whether the request's Host header names the address and port it arrived on."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return False
    host = request.headers.get("Host", "")
    return await asyncio.to_thread(host_names_this_server, host, int(sockname[1]), _is_local)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_BODY = web.RequestKey("mlxpp_admin_body", bytes)


def add_admin_routes(
    app: web.Application,
    controller: AdminController,
    verifier: AdminVerifier,
    *,
    on_auth_failure: Callable[[str], None] | None = None,
) -> None:
    """Add the admin routes (docs/admin-api.md) to ``app``: every one signed but the
    challenge and the OpenAPI document."""

    async def status(request: web.Request) -> web.Response:
        document = status_document(await controller.status())
        return _json(document.model_dump(mode="json"))

    async def drain(request: web.Request) -> web.Response:
        return _json(await controller.drain())

    async def resume(request: web.Request) -> web.Response:
        return _json(await controller.resume())

    async def repartition(request: web.Request) -> web.Response:
        raw = request[_BODY] or b"{}"
        try:
            body = RepartitionRequest.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return error_response(
                ApiError(400, f"{where}: {first['msg']}", code="invalid_repartition_request")
            )
        outcome = await controller.repartition(body.stage_memory, body.pp_layers)
        return _json(outcome, status=202 if outcome.get("accepted") else 409)

    async def prepare(request: web.Request) -> web.Response:
        try:
            body = PrepareRequest.model_validate_json(request[_BODY] or b"{}")
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return error_response(
                ApiError(400, f"{where}: {first['msg']}", code="invalid_prepare_request")
            )
        outcome = await controller.prepare(body.max_rate_bytes_s, body.nodes)
        return _json(outcome, status=202 if outcome.get("accepted") else 409)

    async def events(request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "-1"))
        except ValueError:
            return error_response(ApiError(400, "after must be an integer", code="invalid_after"))
        return _json((await controller.events(after)).model_dump(mode="json"))

    refusals = LogThrottle()

    def guarded(route: str, action: Callable[[web.Request], Awaitable[web.Response]]) -> Handler:
        return _guarded(route, action, verifier, on_auth_failure, refusals)

    async def challenge_route(request: web.Request) -> web.Response:
        return _json({"scheme": verifier.scheme, "cluster": verifier.cluster_name})

    openapi_body = admin_openapi_text().encode()

    async def openapi_route(request: web.Request) -> web.Response:
        return web.Response(body=openapi_body, content_type="application/json", charset="utf-8")

    app.router.add_get(CHALLENGE_PATH, challenge_route, allow_head=False)
    # Unsigned like the challenge: the shape of the routes, the same for every cluster.
    app.router.add_get(ADMIN_OPENAPI_PATH, openapi_route, allow_head=False)

    app.router.add_get(STATUS_PATH, guarded(STATUS_PATH, status), allow_head=False)
    app.router.add_post(DRAIN_PATH, guarded(DRAIN_PATH, drain))
    app.router.add_post(RESUME_PATH, guarded(RESUME_PATH, resume))
    app.router.add_post(REPARTITION_PATH, guarded(REPARTITION_PATH, repartition))
    app.router.add_get(EVENTS_PATH, guarded(EVENTS_PATH, events), allow_head=False)
    app.router.add_post(PREPARE_PATH, guarded(PREPARE_PATH, prepare))
    for path, action in _adapter_routes(controller).items():
        app.router.add_post(path, guarded(path, action))


def _adapter_routes(
    controller: AdminController,
) -> dict[str, Callable[[web.Request], Awaitable[web.Response]]]:
    """POST /admin/v1/adapters (load) and /admin/v1/adapters/unload (docs/adapters.md)."""

    async def adapter_load(request: web.Request) -> web.Response:
        try:
            body = AdapterLoadRequest.model_validate_json(request[_BODY] or b"{}")
        except ValidationError as exc:
            return error_response(_invalid(exc, "invalid_adapter_request"))
        outcome = await controller.adapter_load(body.name, body.path)
        return _json(outcome, status=200 if outcome.get("accepted") else 409)

    async def adapter_unload(request: web.Request) -> web.Response:
        try:
            body = AdapterUnloadRequest.model_validate_json(request[_BODY] or b"{}")
        except ValidationError as exc:
            return error_response(_invalid(exc, "invalid_adapter_request"))
        outcome = await controller.adapter_unload(body.name, body.drain_timeout_s)
        return _json(outcome, status=200 if outcome.get("accepted") else 409)

    return {ADAPTERS_PATH: adapter_load, ADAPTERS_UNLOAD_PATH: adapter_unload}


def _invalid(exc: ValidationError, code: str) -> ApiError:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return ApiError(400, f"{where}: {first['msg']}", code=code)


def _json(document: dict[str, Any], status: int = 200) -> web.Response:
    # Cluster state is live: a cache in between must never answer for the coordinator.
    return web.json_response(document, status=status, headers={"Cache-Control": "no-store"})


def _guarded(
    route: str,
    action: Callable[[web.Request], Awaitable[web.Response]],
    verifier: AdminVerifier,
    on_auth_failure: Callable[[str], None] | None,
    refusals: LogThrottle,
) -> Handler:
    """``action`` behind a signature checked as far as the header goes before any of the body
    is read, a bounded body, the whole signature verified, and one JSON error on failure."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            # Missing, malformed or stale: refused unread, so a client without the key holds
            # nothing (the listener drains and closes the rest).
            verifier.check_header(request.headers.get("Authorization"))
        except AdminAuthError as exc:
            return _refused(request, route, exc, verifier, on_auth_failure, refusals)
        try:
            body = await read_bounded(request, MAX_ADMIN_BODY_BYTES, "an admin request body")
        except ApiError as error:
            return error_response(error)
        try:
            # raw_path is the path (and query) exactly as the client sent and signed it.
            operator = verifier.verify(
                request.headers.get("Authorization"),
                request.method,
                request.raw_path,
                body,
                host=request.headers.get("Host", ""),
            )
            # The signature covers the Host; a replay to another server still names the first.
            if not await _names_this_server(request):
                raise AdminAuthError("wrong_host")
        except AdminAuthError as exc:
            return _refused(request, route, exc, verifier, on_auth_failure, refusals)
        request[_BODY] = body
        if request.method != "GET":
            # Who changed the cluster, for the record; the name passed the header's pattern.
            log.info(
                "admin request %s %s signed by %s",
                request.method,
                route,
                f"operator {escape(operator, 255)}" if operator else "the cluster secret",
            )
        try:
            return await action(request)
        except ConnectionError:
            raise  # the client left: the base app counts it in one quiet line (http/base_app.py)
        except Exception:
            log.exception("admin request %s %s failed", request.method, route)
            return error_response(
                ApiError(
                    500,
                    "the admin request failed; the coordinator's log has the details",
                    type="server_error",
                    code="internal_error",
                )
            )

    return handler


def _refused(
    request: web.Request,
    route: str,
    exc: AdminAuthError,
    verifier: AdminVerifier,
    on_auth_failure: Callable[[str], None] | None,
    refusals: LogThrottle,
) -> web.Response:
    # Anyone can be refused at will: one line per interval, with the counts since the last.
    # The route, not the raw path, and never the header: neither can smuggle text in.
    if (counts := refusals.note(exc.reason)) is not None:
        log.warning(
            "admin request refused: %s %s from %s: %s (refusals since the last line: %s)",
            request.method,
            route,
            escape(request.remote or "unknown peer", 64),
            exc.reason,
            counts,
        )
    if on_auth_failure is not None:
        on_auth_failure(exc.reason)
    return error_response(
        ApiError(
            401,
            _MESSAGES[exc.reason],
            type="authentication_error",
            code=exc.reason,
            # The cluster to sign for: no secret, and it tells a client why its MAC failed.
            headers={"WWW-Authenticate": challenge(verifier.cluster_name, verifier.scheme)},
        )
    )
