"""Without an API key, the API answers only requests a web page elsewhere cannot make.

A browser lets any page send a "simple" cross-origin POST (``Content-Type: text/plain``, no
preflight), and a DNS-rebinding page reaches a loopback server under its own name. With a key
neither gets anywhere (the page cannot add the key). Without one, the paths a key would guard
(``/v1/``, ``/metrics``, ``/console/v1/``) take only requests whose ``Host`` names this listener
(a loopback name or address, the host it is bound to, or the address the connection arrived
on), whose ``Origin``, when sent, names one of those too, and whose body is
``application/json``, which a page can only send after a preflight this server never answers.
No name is resolved here: an unauthenticated request costs no DNS lookup. A page on an origin
the operator listed for CORS (``http/cors.py``) passes the Origin check.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Set
from urllib.parse import urlsplit

from aiohttp import web

from mlxppd.core.log_text import quoted
from mlxppd.http.errors import ApiError

#: methods whose body must be JSON
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def host_name(host: str) -> str | None:
    """The name in a ``Host`` value (``name``, ``name:port``, ``[v6]`` or ``[v6]:port``),
    lower-cased, without brackets or a trailing dot; None when it is malformed."""
    host = host.strip().lower()
    if host.startswith("["):
        name, bracket, rest = host[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
    else:
        name, colon, port = host.partition(":")
        if colon and not port.isdigit():
            return None
    name = name.rstrip(".")
    return name or None


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def names_this_listener(name: str, own: Set[str]) -> bool:
    """Whether ``name`` (from ``host_name``) is a loopback name or address, or one of ``own``
    (the listener's bound hosts and the connection's local address)."""
    if name == "localhost" or name.endswith(".localhost"):
        return True  # RFC 6761: these are loopback, whatever a resolver says
    address = _address(name)
    if address is None:
        return name in own
    if address.is_loopback:
        return True
    return any(_address(o) == address for o in own)


def own_names(request: web.Request, listen_hosts: Set[str]) -> set[str]:
    """The listener's bound hosts (wildcards aside) and the address the request arrived on."""
    names = {h.strip("[]") for h in listen_hosts if h not in _WILDCARDS}
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if isinstance(sockname, tuple) and sockname:
        names.add(str(sockname[0]).lower())
    return names


def check_same_origin(
    request: web.Request, listen_hosts: Set[str], *, origin_admitted: bool = False
) -> None:
    """Raise a 403 when the request's Host or Origin names another server, a 415 when its body
    is not JSON; ``listen_hosts``: the hosts this app's listeners are bound to.
    ``origin_admitted``: the Origin is one the CORS policy lets call this path
    (``http/cors.py``), so it passes; the Host and the content type are checked all the same."""
    own = own_names(request, listen_hosts)
    host = request.headers.get("Host", "")
    name = host_name(host)
    if name is None or not names_this_listener(name, own):
        raise ApiError(
            403,
            f"this server has no API key, so it answers only requests sent to it by a local "
            f"name or its own address, and the Host header {quoted(host, 80)} is neither; "
            "send the request to localhost or the address it listens on, or start it with an "
            "API key",
            type="permission_error",
            code="host_not_allowed",
        )
    origin = request.headers.get("Origin")
    if origin is not None and not origin_admitted and not _origin_allowed(origin, own):
        raise ApiError(
            403,
            f"this server has no API key, so it refuses requests from web pages served "
            f"elsewhere, and this one comes from {quoted(origin, 80)}; open the page from "
            "this server, list its origin with --cors-origin (cors_origins in mlxppd.toml), "
            "or start the server with an API key",
            type="permission_error",
            code="origin_not_allowed",
        )
    if request.method in _BODY_METHODS and request.content_type != "application/json":
        sent = request.headers.get("Content-Type", "")
        raise ApiError(
            415,
            f"this server has no API key, so a request body must be sent as "
            f"'Content-Type: application/json' (this one is {quoted(sent, 80)})",
            code="unsupported_media_type",
        )


def _origin_allowed(origin: str, own: Set[str]) -> bool:
    try:
        parts = urlsplit(origin.strip())
        netloc = parts.netloc
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not netloc or "@" in netloc:
        return False  # "null" (a sandboxed frame, a file) included
    name = host_name(netloc)
    return name is not None and names_this_listener(name, own)
