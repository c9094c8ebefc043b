"""Without an API key, the API answers only requests a web page elsewhere cannot make: its Host
names this listener, its Origin (when sent) too, and its body is JSON. With a key none of this
applies (a page cannot send the key). The real app on the nodes' own listener, over a backend
without a model: a request that passes the checks gets that backend's 503, not a 403 or 415.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from mlxppd.app.api_app import api_app
from mlxppd.http.same_origin import host_name, names_this_listener
from tests.support.admin_server import IdleBackend
from tests.support.http import LoopThread, request

KEY = "sk-same-origin-test"
BODY = b'{"prompt": "hi", "max_tokens": 4}'


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    loop = LoopThread("same-origin-test")
    try:
        yield {
            "keyless": loop.serve(api_app(IdleBackend())),
            "keyed": loop.serve(api_app(IdleBackend(), api_key=KEY)),
        }
    finally:
        loop.stop()


def send(url: str, path: str, headers: dict[str, str], body: bytes = BODY) -> tuple[int, Any]:
    host = url.split("://", 1)[1]
    status, _, parsed = request(
        url, "POST", path, raw=body, headers={"Host": host, **headers}, timeout=30
    )
    return status, parsed


def test_a_text_plain_body_without_a_key_is_a_415_that_says_what_to_send(
    servers: dict[str, str],
) -> None:
    status, body = send(servers["keyless"], "/v1/completions", {"Content-Type": "text/plain"})
    assert status == 415, body
    assert body["error"]["code"] == "unsupported_media_type"
    assert "application/json" in body["error"]["message"]
    status, body = send(servers["keyless"], "/v1/completions", {})  # JSON: past the checks
    assert status == 503, body


def test_a_host_that_names_another_server_is_a_403(servers: dict[str, str]) -> None:
    """A DNS-rebinding page reaches the loopback listener under its own name."""
    for path in ("/v1/completions", "/console/v1/plan"):
        status, body = send(servers["keyless"], path, {"Host": "evil.example:8080"})
        assert status == 403, body
        assert body["error"]["code"] == "host_not_allowed"
        assert "'evil.example:8080'" in body["error"]["message"]
    status, _, body = request(
        servers["keyless"], "GET", "/v1/models", headers={"Host": "rebound.example"}, timeout=30
    )
    assert status == 403 and body["error"]["code"] == "host_not_allowed"


def test_a_page_from_another_origin_is_a_403_and_this_servers_own_page_is_served(
    servers: dict[str, str],
) -> None:
    url = servers["keyless"]
    for origin in ("http://evil.example", "null", "file://", "http://127.0.0.1.evil.example"):
        status, body = send(url, "/v1/completions", {"Origin": origin})
        assert status == 403, (origin, body)
        assert body["error"]["code"] == "origin_not_allowed"
    for origin in (url, "http://localhost:3000", "https://[::1]"):
        assert send(url, "/v1/completions", {"Origin": origin})[0] == 503, origin


def test_the_messages_api_refuses_in_its_own_shape(servers: dict[str, str]) -> None:
    status, body = send(servers["keyless"], "/v1/messages", {"Content-Type": "text/plain"})
    assert status == 415
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    status, body = send(servers["keyless"], "/v1/messages", {"Origin": "http://evil.example"})
    assert status == 403 and body["error"]["type"] == "permission_error"


def test_with_a_key_the_key_is_what_counts(servers: dict[str, str]) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"}
    headers = {**auth, "Origin": "http://evil.example", "Host": "any.example"}
    assert send(servers["keyed"], "/v1/completions", headers)[0] == 503
    assert send(servers["keyed"], "/v1/completions", {"Origin": "http://evil.example"})[0] == 401


def test_the_unguarded_paths_stay_open(servers: dict[str, str]) -> None:
    status, _, body = request(
        servers["keyless"], "GET", "/health", headers={"Host": "probe.example"}, timeout=30
    )
    assert status == 200 and body["status"] == "ok"


@pytest.mark.parametrize(
    ("host", "name"),
    [
        ("LocalHost:8080", "localhost"),
        ("[::1]:80", "::1"),
        ("[::1]", "::1"),
        ("10.0.0.5", "10.0.0.5"),
        ("node.lan.:8080", "node.lan"),
        ("a:b", None),
        ("[::1]x", None),
        ("", None),
    ],
)
def test_the_name_in_a_host_header(host: str, name: str | None) -> None:
    assert host_name(host) == name


def test_which_names_are_this_listeners() -> None:
    own = {"node.lan", "192.168.1.5"}
    assert names_this_listener("localhost", own)
    assert names_this_listener("app.localhost", own)
    assert names_this_listener("127.0.0.2", own)
    assert names_this_listener("::1", own)
    assert names_this_listener("::ffff:192.168.1.5", own)
    assert names_this_listener("node.lan", own)
    assert not names_this_listener("192.168.1.6", own)
    assert not names_this_listener("localhost.evil.example", own)
    assert not names_this_listener("evil.example", own)
