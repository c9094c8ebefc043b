"""The CORS rules as pure decisions (``mlxppd/http/cors.py``, ``mlxppd/core/config/origins.py``):
which spellings are origins and how they compare, that ``*`` is refused with an API key (from
``create_app``, ``mlxppd.toml`` and ``mlxppd serve --cors-origin``, each saying why and what to
do), which paths CORS covers, what a preflight's answer says (the origin echoed, the methods,
the SDKs' request headers, a max age) and that a disallowed origin gets no CORS header at all.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mlxppd.core.config.host import load_host_settings
from mlxppd.core.config.origins import (
    MAX_ORIGINS,
    canonical_origin,
    parse_origin,
    parse_origins,
    wildcard_problem,
)
from mlxppd.core.errors import ConfigurationError
from mlxppd.http.cors import (
    ALLOW_HEADERS,
    EXPOSE_HEADERS,
    MAX_AGE_S,
    CorsPolicy,
    allowed_request_headers,
    is_api_path,
    is_preflight,
    preflight_headers,
    response_headers,
)
from tests.support.agents import VENV_BIN

APP = "https://chat.example.com"
#: what Chromium sends before the openai SDK's streamed chat completion from a page
SDK_PREFLIGHT = {
    "Origin": APP,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type,x-stainless-arch,"
    "x-stainless-lang,x-stainless-os,x-stainless-package-version,x-stainless-retry-count,"
    "x-stainless-runtime,x-stainless-runtime-version,x-stainless-timeout",
}


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        ("https://chat.example.com", "https://chat.example.com"),
        ("HTTPS://Chat.Example.COM/", "https://chat.example.com"),
        ("https://chat.example.com:443", "https://chat.example.com"),
        ("http://localhost:80", "http://localhost"),
        ("http://localhost:5173", "http://localhost:5173"),
        ("http://127.0.0.1:08080", "http://127.0.0.1:8080"),
        ("http://[::1]:3000", "http://[::1]:3000"),
        ("chrome-extension://abcdefghijklmnop", "chrome-extension://abcdefghijklmnop"),
    ],
)
def test_an_origin_has_one_canonical_spelling(written: str, canonical: str) -> None:
    assert parse_origin(written) == canonical
    assert canonical_origin(written) == canonical


@pytest.mark.parametrize(
    "text",
    [
        "chat.example.com",  # no scheme
        "https://chat.example.com/app",  # a path: browsers never send one
        "https://user@chat.example.com",
        "https://chat.example.com:0",
        "https://chat.example.com:65536",
        "https://chat.example.com?x=1",
        "null",  # a sandboxed frame or a file
        "https://" + "a" * 300,
        "https://bad host",
    ],
)
def test_what_is_not_an_origin_is_refused_saying_how_to_write_one(text: str) -> None:
    with pytest.raises(ValueError, match=r"scheme://host\[:port\]|at most 300"):
        parse_origin(text)
    assert canonical_origin(text) is None


def test_the_list_is_canonical_without_duplicates_and_bounded() -> None:
    assert parse_origins([APP, APP.upper() + "/", "*", " * "]) == (APP, "*")
    with pytest.raises(ValueError, match=f"at most {MAX_ORIGINS} origins"):
        parse_origins([f"http://h{i}.example" for i in range(MAX_ORIGINS + 1)])


def test_every_origin_is_refused_with_an_api_key_saying_why_and_what_to_do() -> None:
    assert wildcard_problem(["*"], has_api_key=False) is None
    assert wildcard_problem([APP], has_api_key=True) is None
    problem = wildcard_problem(["*"], has_api_key=True)
    assert problem is not None
    assert "API key" in problem and "list the origins" in problem
    with pytest.raises(ValueError, match="cannot be a CORS origin of a server with an API key"):
        CorsPolicy.of(["*"], has_api_key=True)


def test_the_host_file_takes_origins_and_refuses_every_origin_beside_a_key(
    tmp_path: Path,
) -> None:
    settings = load_host_settings(
        tmp_path, environ={"MLXPP_CORS_ORIGINS": f"{APP}/, http://localhost:5173"}
    )
    assert settings.cors_origins == (APP, "http://localhost:5173")
    (tmp_path / "mlxppd.toml").write_text('cors_origins = ["*"]\napi_key = "k"\n')
    with pytest.raises(ConfigurationError, match="cors_origins: '\\*' \\(every web page\\)"):
        load_host_settings(tmp_path, environ={})
    (tmp_path / "mlxppd.toml").write_text('cors_origins = ["https://chat.example.com/app"]\n')
    with pytest.raises(ConfigurationError, match=r"cors_origins.*is not an origin.*\(line 1\)"):
        load_host_settings(tmp_path, environ={})


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--cors-origin", "*", "--api-key", "k"], "cannot be a CORS origin"),
        (["--cors-origin", "chat.example.com"], "is not an origin"),
    ],
)
def test_serve_refuses_a_bad_cors_flag_before_anything_starts(flags: list[str], says: str) -> None:
    done = subprocess.run(
        [str(VENV_BIN / "mlxppd"), "serve", *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--cors-origin" in done.stderr and says in done.stderr


def test_a_policy_allows_its_origins_in_any_spelling_and_nothing_else() -> None:
    policy = CorsPolicy.of([APP, "http://localhost:5173"], has_api_key=True)
    assert policy.allows(APP) and policy.allows("https://CHAT.example.com:443")
    assert not policy.allows("https://chat.example.com.evil.example")
    assert not policy.allows("http://chat.example.com")  # another scheme is another origin
    assert not policy.allows("http://localhost:5174")
    assert not policy.allows("null") and not policy.allows(None)
    every = CorsPolicy.of(["*"], has_api_key=False)
    assert every.allows("https://anything.example") and every.allows("null")
    assert not CorsPolicy.of([], has_api_key=False).enabled


@pytest.mark.parametrize(
    ("path", "covered"),
    [
        ("/v1/chat/completions", True),
        ("/v1/messages", True),
        ("/api/chat", True),
        ("/health", True),
        ("/openapi.json", True),
        ("/admin/v1/status", False),
        ("/console/v1/state", False),
        ("/console", False),
        ("/metrics", False),
        ("/v1", False),
    ],
)
def test_cors_covers_the_api_paths_only(path: str, covered: bool) -> None:
    assert is_api_path(path) is covered


def test_a_preflight_is_an_options_with_origin_and_requested_method() -> None:
    assert is_preflight("OPTIONS", SDK_PREFLIGHT)
    assert not is_preflight("OPTIONS", {"Origin": APP})
    assert not is_preflight("POST", SDK_PREFLIGHT)


def test_a_preflight_from_a_listed_origin_allows_what_the_sdks_send() -> None:
    headers = preflight_headers(CorsPolicy.of([APP], has_api_key=True), SDK_PREFLIGHT)
    assert headers is not None
    assert headers["Access-Control-Allow-Origin"] == APP and headers["Vary"] == "Origin"
    assert headers["Access-Control-Allow-Methods"] == "GET, HEAD, POST, DELETE, OPTIONS"
    assert headers["Access-Control-Max-Age"] == str(MAX_AGE_S)
    allowed = headers["Access-Control-Allow-Headers"].split(", ")
    requested = SDK_PREFLIGHT["Access-Control-Request-Headers"].split(",")
    assert set(requested) <= set(allowed)  # what the browser checks
    for sent in ("x-api-key", "anthropic-version", "anthropic-dangerous-direct-browser-access"):
        assert sent in allowed
    assert "Access-Control-Allow-Private-Network" not in headers
    private = {**SDK_PREFLIGHT, "Access-Control-Request-Private-Network": "true"}
    answered = preflight_headers(CorsPolicy.of([APP], has_api_key=True), private)
    assert answered is not None and answered["Access-Control-Allow-Private-Network"] == "true"


def test_a_preflight_from_another_origin_is_refused() -> None:
    policy = CorsPolicy.of([APP], has_api_key=True)
    assert preflight_headers(policy, {**SDK_PREFLIGHT, "Origin": "https://evil.example"}) is None
    assert preflight_headers(policy, {"Access-Control-Request-Method": "POST"}) is None


def test_only_the_sdks_headers_are_allowed_and_none_that_could_break_the_line() -> None:
    asked = "X-Stainless-Helper-Method, x-custom, x-stainless-a\r\nset-cookie: x, x-stainless-b"
    assert allowed_request_headers(asked) == (
        *ALLOW_HEADERS,
        "x-stainless-b",
        "x-stainless-helper-method",
    )


def test_an_actual_response_carries_the_origin_and_what_a_page_may_read() -> None:
    policy = CorsPolicy.of([APP], has_api_key=True)
    assert response_headers(policy, APP) == {
        "Access-Control-Allow-Origin": APP,
        "Access-Control-Expose-Headers": ", ".join(EXPOSE_HEADERS),
    }
    assert "x-request-id" in EXPOSE_HEADERS and "retry-after" in EXPOSE_HEADERS
    assert response_headers(policy, "https://evil.example") == {}
    assert response_headers(policy, None) == {}
