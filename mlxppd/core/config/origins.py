"""Web origins the HTTP API answers cross-origin (CORS) requests from: one spelling rule for
``mlxppd serve --cors-origin``, ``mlxppd.toml``'s ``cors_origins`` and a request's ``Origin``.

An origin is ``scheme://host[:port]`` (``https://chat.example.com``, ``http://localhost:5173``,
``http://[::1]:3000``, ``chrome-extension://<id>``), compared in one canonical spelling: lower
case, without the scheme's default port or a trailing ``/``. ``*`` stands for every origin; a
server with an API key refuses it (``wildcard_problem``). The decisions on requests are
``mlxppd/http/cors.py``'s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "MAX_ORIGINS",
    "MAX_ORIGIN_CHARS",
    "WILDCARD",
    "canonical_origin",
    "parse_origin",
    "parse_origins",
    "wildcard_problem",
]

WILDCARD = "*"
#: origins one server lists (a handful of web apps; the bound keeps the check per request cheap)
MAX_ORIGINS = 64
#: a scheme, "://", a 253-character DNS name and a port fit with room to spare
MAX_ORIGIN_CHARS = 300
_DEFAULT_PORTS = {"http": "80", "https": "443"}
_ORIGIN = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]{0,31})://"
    r"(?P<host>[a-z0-9._~-]{1,253}|\[[0-9a-f:.]{2,45}\])"
    r"(?::(?P<port>[0-9]{1,5}))?/?"
)


def parse_origin(text: str) -> str:
    """``text`` as a canonical origin; ValueError saying what is wrong and what to write."""
    if len(text) > MAX_ORIGIN_CHARS:
        raise ValueError(f"an origin is at most {MAX_ORIGIN_CHARS} characters")
    match = _ORIGIN.fullmatch(text.strip().lower())
    if match is None or (match["port"] and not 0 < int(match["port"]) < 65536):
        shown = text if len(text) <= 60 else text[:60] + "..."
        raise ValueError(
            f"{shown!r} is not an origin; write scheme://host[:port] with no path, as a browser "
            "sends it, e.g. https://chat.example.com or http://localhost:5173 (or '*' for every "
            "origin)"
        )
    scheme, host, port = match["scheme"], match["host"], match["port"]
    if port is None or _DEFAULT_PORTS.get(scheme) == port.lstrip("0"):
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{int(port)}"


def canonical_origin(header: str) -> str | None:
    """A request's ``Origin`` header in the canonical spelling; None when it is not one
    (``null``, from a sandboxed frame or a file, included)."""
    try:
        return parse_origin(header)
    except ValueError:
        return None


def parse_origins(values: Sequence[str]) -> tuple[str, ...]:
    """The configured origins, canonical, duplicates dropped, ``*`` kept as it is; ValueError
    naming the first that is not an origin, or too many."""
    if len(values) > MAX_ORIGINS:
        raise ValueError(
            f"at most {MAX_ORIGINS} origins may be listed, got {len(values)}; list the web "
            "apps that call the API, or '*' for every origin"
        )
    out: list[str] = []
    for value in values:
        origin = WILDCARD if value.strip() == WILDCARD else parse_origin(value)
        if origin not in out:
            out.append(origin)
    return tuple(out)


def wildcard_problem(origins: Sequence[str], has_api_key: bool) -> str | None:
    """Why these origins cannot go with an API key (``*`` with one), or None."""
    if has_api_key and WILDCARD in origins:
        return (
            "'*' (every web page) cannot be a CORS origin of a server with an API key: the key "
            "decides who may call, and '*' would let pages on any site spend it once it reaches "
            "a browser; list the origins of your own web apps instead (e.g. "
            "https://chat.example.com), or serve without an API key"
        )
    return None
