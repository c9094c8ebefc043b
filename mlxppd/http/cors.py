"""Cross-origin requests from web pages (CORS) to the API routes, off unless origins are listed.

``create_app(cors_origins=...)`` turns it on (``enable_cors``) for the origins listed
(``mlxppd/core/config/origins.py``: ``scheme://host[:port]``, or ``*`` for every origin, which
only a server without an API key takes). It covers the API paths (``/v1/``, ``/api/``,
``/health``, ``/openapi.json``), never ``/admin`` or the console's keyed routes:

- A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
  by the middleware before the API key is asked for, since a browser sends no key on one: 204
  with the origin echoed, the methods, the request headers the SDKs send and a max age; from
  an origin not listed, a 403 and no CORS header.
- Every response to a listed origin, a stream included, carries ``Access-Control-Allow-Origin``
  and the headers a page may read (``x-request-id``, ``retry-after``), set as its headers are
  prepared (aiohttp's ``on_response_prepare``), so before a stream's first byte; a response to
  an origin not listed carries none, and the browser keeps it from the page.
- Without an API key, ``http/same_origin.py`` refuses requests from pages elsewhere; a listed
  origin passes its Origin check (``origin_admitted``), and its Host and content-type checks
  still hold.

The decisions are pure functions of the policy and the request's headers, unit-tested apart
from aiohttp (``tests/http/test_cors_rules.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aiohttp import web

from mlxppd.core.config.origins import WILDCARD, canonical_origin, parse_origins, wildcard_problem
from mlxppd.core.log_text import quoted
from mlxppd.http.errors import ApiError

__all__ = [
    "ALLOW_HEADERS",
    "ALLOW_METHODS",
    "CORS",
    "EXPOSE_HEADERS",
    "MAX_AGE_S",
    "CorsPolicy",
    "allowed_request_headers",
    "answer_preflight",
    "enable_cors",
    "is_api_path",
    "is_preflight",
    "origin_admitted",
    "preflight_headers",
    "response_headers",
]

_API_PREFIXES = ("/v1/", "/api/")
_API_PATHS = frozenset({"/health", "/openapi.json"})
ALLOW_METHODS = ("GET", "HEAD", "POST", "DELETE", "OPTIONS")
#: what the OpenAI and Anthropic SDKs send from a browser (besides the x-stainless-* headers)
ALLOW_HEADERS = (
    "authorization",
    "content-type",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "openai-beta",
    "openai-organization",
    "openai-project",
    "user-agent",
)
#: the SDKs' platform headers (x-stainless-lang, -os, -retry-count, -timeout, ...), a family
#: that grows with each SDK release: every one a preflight asks for is allowed
_STAINLESS_PREFIX = "x-stainless-"
#: the response headers a page may read besides the safelisted ones
EXPOSE_HEADERS = ("x-request-id", "request-id", "retry-after")
#: how long a browser may reuse a preflight's answer (Chromium caps it at 7200)
MAX_AGE_S = 600
#: a preflight names at most this many headers; more is no SDK's request
_MAX_REQUESTED_HEADERS = 64


@dataclass(frozen=True)
class CorsPolicy:
    """The origins whose pages may call the API (canonical spellings; ``every_origin``: ``*``)."""

    origins: frozenset[str] = frozenset()
    every_origin: bool = False

    @classmethod
    def of(cls, origins: Sequence[str], *, has_api_key: bool) -> CorsPolicy:
        """The policy of the configured origins; ValueError naming what is wrong (a malformed
        origin, too many, ``*`` with an API key)."""
        parsed = parse_origins(origins)
        if (problem := wildcard_problem(parsed, has_api_key)) is not None:
            raise ValueError(problem)
        return cls(frozenset(o for o in parsed if o != WILDCARD), WILDCARD in parsed)

    @property
    def enabled(self) -> bool:
        return self.every_origin or bool(self.origins)

    def allows(self, origin: str | None) -> bool:
        """Whether a request whose ``Origin`` header is ``origin`` may be answered to its page."""
        if origin is None:
            return False
        if self.every_origin:
            return True
        return canonical_origin(origin) in self.origins


def is_api_path(path: str) -> bool:
    """Whether CORS covers ``path``: the APIs, never /admin, the console or /metrics."""
    return path.startswith(_API_PREFIXES) or path in _API_PATHS


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    """Whether a request is a browser's CORS preflight (not any OPTIONS)."""
    return (
        method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers
    )


def allowed_request_headers(requested: str) -> tuple[str, ...]:
    """The request headers a preflight's answer allows: ``ALLOW_HEADERS`` and the
    x-stainless-* ones that ``requested`` (its Access-Control-Request-Headers) names."""
    names = [n.strip().lower() for n in requested.split(",")[:_MAX_REQUESTED_HEADERS]]
    extra = sorted({n for n in names if n.startswith(_STAINLESS_PREFIX) and n.isascii()})
    return ALLOW_HEADERS + tuple(n for n in extra if _token(n))


def _token(name: str) -> bool:
    # An HTTP header name: nothing that could end the header line or start another.
    return all(c.isalnum() or c in "-_." for c in name)


def preflight_headers(policy: CorsPolicy, headers: Mapping[str, str]) -> dict[str, str] | None:
    """The headers of the answer to a preflight with request ``headers``; None when its origin
    may not call (the preflight is refused, with no CORS header)."""
    origin = headers.get("Origin")
    if origin is None or not policy.allows(origin):
        return None
    out = {
        "Access-Control-Allow-Origin": origin,
        "Vary": "Origin",
        "Access-Control-Allow-Methods": ", ".join(ALLOW_METHODS),
        "Access-Control-Allow-Headers": ", ".join(
            allowed_request_headers(headers.get("Access-Control-Request-Headers", ""))
        ),
        "Access-Control-Max-Age": str(MAX_AGE_S),
    }
    if headers.get("Access-Control-Request-Private-Network", "").lower() == "true":
        # Chromium asks before a public page reaches a private address; the origin is listed.
        out["Access-Control-Allow-Private-Network"] = "true"
    return out


def response_headers(policy: CorsPolicy, origin: str | None) -> dict[str, str]:
    """The CORS headers of an actual response to a page of ``origin`` (none when the origin
    may not call: the browser then keeps the response from the page)."""
    if origin is None or not policy.allows(origin):
        return {}
    return {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Expose-Headers": ", ".join(EXPOSE_HEADERS),
    }


# --- on an aiohttp app ---

CORS = web.AppKey("mlxpp_cors", CorsPolicy)


def enable_cors(app: web.Application, policy: CorsPolicy) -> None:
    """Answer ``policy``'s origins on ``app``'s API paths (an app from ``base_app``, whose
    middleware answers the preflights); nothing changes when the policy lists no origin."""
    if not policy.enabled:
        return
    app[CORS] = policy
    app.on_response_prepare.append(_add_headers)


def _policy(request: web.Request) -> CorsPolicy | None:
    if not is_api_path(request.path):
        return None
    return request.app.get(CORS)


def answer_preflight(request: web.Request) -> web.Response | None:
    """The answer to a preflight on an API path (204), a 403 ``ApiError`` when its origin is
    not listed; None for any other request, or when CORS is off."""
    policy = _policy(request)
    if policy is None or not is_preflight(request.method, request.headers):
        return None
    headers = preflight_headers(policy, request.headers)
    if headers is None:
        origin = request.headers.get("Origin", "")
        raise ApiError(
            403,
            f"this server does not answer web pages from {quoted(origin, 80)} (CORS); list "
            "that origin with --cors-origin or cors_origins in mlxppd.toml",
            type="permission_error",
            code="cors_origin_not_allowed",
        )
    return web.Response(status=204, headers=headers)


def origin_admitted(request: web.Request) -> bool:
    """Whether the request's ``Origin`` is one CORS lets call its path (``http/same_origin.py``
    then lets it pass the Origin check)."""
    policy = _policy(request)
    return policy is not None and policy.allows(request.headers.get("Origin"))


async def _add_headers(request: web.Request, response: web.StreamResponse) -> None:
    policy = _policy(request)
    if policy is None or "Access-Control-Allow-Origin" in response.headers:
        return  # not an API path, or a preflight's answer, which has them already
    vary = response.headers.get("Vary")
    if vary is None:
        response.headers["Vary"] = "Origin"
    elif "origin" not in vary.lower():
        response.headers["Vary"] = f"{vary}, Origin"
    response.headers.update(response_headers(policy, request.headers.get("Origin")))
