"""CORS on the wire (``mlxppd/http/cors.py`` in the base app's middleware), on the nodes' own
listener over a backend without a model (a request past every check gets its 503):

- a preflight from a listed origin is a 204 without the API key, whatever path of the APIs it
  names; from another origin a 403 with no CORS header; on /admin and the console's routes it
  is not answered as CORS at all;
- an actual response to a listed origin carries the origin and the headers a page may read,
  errors included; to another origin none;
- without an API key, a listed origin passes the same-origin check's Origin rule while its
  Host and content-type rules still hold, and an unlisted one is refused as before;
- with no origin listed (the default) nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from mlxppd.app.api_app import api_app
from tests.support.admin_server import IdleBackend
from tests.support.http import LoopThread, request

KEY = "sk-cors-wire-test"
APP = "https://chat.example.com"
EVIL = "https://evil.example"
PREFLIGHT = {
    "Origin": APP,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os",
}
BODY = b'{"prompt": "hi", "max_tokens": 4}'


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    loop = LoopThread("cors-wire-test")
    try:
        yield {
            "keyed": loop.serve(api_app(IdleBackend(), api_key=KEY, cors_origins=[APP])),
            "keyless": loop.serve(api_app(IdleBackend(), cors_origins=[APP])),
            "off": loop.serve(api_app(IdleBackend(), api_key=KEY)),
        }
    finally:
        loop.stop()


def call(
    url: str, method: str, path: str, headers: dict[str, str], body: bytes | None = None
) -> tuple[int, dict[str, str], Any]:
    host = url.split("://", 1)[1]
    return request(url, method, path, raw=body, headers={"Host": host, **headers}, timeout=30)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/chat", "/health"])
def test_a_preflight_from_a_listed_origin_needs_no_key(servers: dict[str, str], path: str) -> None:
    status, headers, _ = call(servers["keyed"], "OPTIONS", path, PREFLIGHT)
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == APP and headers["Vary"] == "Origin"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "x-stainless-os" in headers["Access-Control-Allow-Headers"]


def test_a_preflight_from_another_origin_is_a_403_without_cors_headers(
    servers: dict[str, str],
) -> None:
    for server in ("keyed", "keyless"):
        status, headers, body = call(
            servers[server], "OPTIONS", "/v1/chat/completions", {**PREFLIGHT, "Origin": EVIL}
        )
        assert status == 403, body
        assert body["error"]["code"] == "cors_origin_not_allowed"
        assert "--cors-origin" in body["error"]["message"]
        assert "Access-Control-Allow-Origin" not in headers
    # Anthropic's path answers in Anthropic's shape.
    status, _, body = call(
        servers["keyed"], "OPTIONS", "/v1/messages", {**PREFLIGHT, "Origin": EVIL}
    )
    assert (status, body["error"]["type"]) == (403, "permission_error") and body["type"] == "error"


@pytest.mark.parametrize("path", ["/admin/v1/status", "/console/v1/state", "/metrics"])
def test_admin_and_console_paths_are_not_cors(servers: dict[str, str], path: str) -> None:
    status, headers, _ = call(servers["keyed"], "OPTIONS", path, PREFLIGHT)
    assert status != 204
    assert "Access-Control-Allow-Origin" not in headers


def test_actual_responses_carry_cors_headers_to_a_listed_origin_only(
    servers: dict[str, str],
) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    status, headers, _ = call(servers["keyed"], "GET", "/v1/models", {**auth, "Origin": APP})
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == APP and headers["Vary"] == "Origin"
    assert headers["Access-Control-Expose-Headers"] == "x-request-id, request-id, retry-after"
    # An error reaches the page too (it can show why), here a 401 without the key.
    status, headers, _ = call(servers["keyed"], "GET", "/v1/models", {"Origin": APP})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == APP
    status, headers, _ = call(servers["keyed"], "GET", "/v1/models", {**auth, "Origin": EVIL})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    # The console's keyed routes never answer another origin's page.
    status, headers, _ = call(servers["keyed"], "GET", "/console/v1/state", {**auth, "Origin": APP})
    assert "Access-Control-Allow-Origin" not in headers


def test_without_a_key_a_listed_origin_passes_the_origin_check_and_nothing_else(
    servers: dict[str, str],
) -> None:
    url = servers["keyless"]
    json = {"Content-Type": "application/json"}
    status, headers, body = call(url, "POST", "/v1/completions", {**json, "Origin": APP}, BODY)
    assert status == 503, body  # past the same-origin checks: the backend has no model
    assert headers["Access-Control-Allow-Origin"] == APP
    status, _, body = call(url, "POST", "/v1/completions", {**json, "Origin": EVIL}, BODY)
    assert (status, body["error"]["code"]) == (403, "origin_not_allowed")
    assert "--cors-origin" in body["error"]["message"]
    # The Host rule holds for a listed origin: a DNS-rebinding page is still refused.
    rebound = {**json, "Origin": APP, "Host": "chat.example.com"}
    status, _, body = call(url, "POST", "/v1/completions", rebound, BODY)
    assert (status, body["error"]["code"]) == (403, "host_not_allowed")
    # So does the JSON rule.
    plain = {"Content-Type": "text/plain", "Origin": APP}
    status, _, body = call(url, "POST", "/v1/completions", plain, BODY)
    assert (status, body["error"]["code"]) == (415, "unsupported_media_type")


def test_with_no_origin_listed_nothing_is_answered_as_cors(servers: dict[str, str]) -> None:
    status, headers, _ = call(servers["off"], "OPTIONS", "/v1/chat/completions", PREFLIGHT)
    assert status == 401  # as any request without the key
    status, headers, _ = call(
        servers["off"], "GET", "/v1/models", {"Authorization": f"Bearer {KEY}", "Origin": APP}
    )
    assert status == 200
    assert "Access-Control-Allow-Origin" not in headers and "Vary" not in headers


def test_create_app_refuses_every_origin_beside_a_key() -> None:
    with pytest.raises(ValueError, match="cannot be a CORS origin of a server with an API key"):
        api_app(IdleBackend(), api_key=KEY, cors_origins=["*"])
    with pytest.raises(ValueError, match="is not an origin"):
        api_app(IdleBackend(), cors_origins=["chat.example.com"])
