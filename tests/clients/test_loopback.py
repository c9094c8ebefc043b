"""The loopback guard the client modules run under (``loopback.py``) refuses, and remembers,
every target beyond loopback, and lets loopback, ``localhost`` and Unix sockets through. The
hook is driven with ``sys.audit``, the very call CPython's socket module makes before it
connects or looks a name up, so nothing here opens a socket."""

from __future__ import annotations

import sys

import pytest

from tests.clients.loopback import GUARD, is_local


@pytest.mark.parametrize(
    "target",
    [("127.0.0.1", 80), ("127.8.9.10", 1), ("::1", 443, 0, 0), "localhost", None, "/tmp/x.sock"],
)
def test_local_targets(target: object) -> None:
    assert is_local(target)


@pytest.mark.parametrize(
    "target",
    [("203.0.113.7", 443), ("10.0.0.1", 80), ("api.openai.com", 443), "api.openai.com",
     ("0.0.0.0", 80), ("::ffff:203.0.113.7", 443, 0, 0)],
)  # fmt: skip
def test_outside_targets(target: object) -> None:
    assert not is_local(target)


def test_the_hook_refuses_outside_targets_only_while_on() -> None:
    GUARD.install()
    sys.audit("socket.getaddrinfo", "api.anthropic.com", 443, 0, 0, 0)  # off: let through
    saved, GUARD.refused = GUARD.refused, []
    GUARD.on = True
    try:
        sys.audit("socket.getaddrinfo", "localhost", 443, 0, 0, 0)
        with pytest.raises(ConnectionRefusedError, match="loopback-only"):
            sys.audit("socket.connect", None, ("203.0.113.7", 443))
        with pytest.raises(ConnectionRefusedError):
            sys.audit("socket.getaddrinfo", "api.anthropic.com", 443, 0, 0, 0)
        refused = list(GUARD.refused)
    finally:
        GUARD.on = False
        GUARD.refused = saved
    assert refused == [
        "socket.connect ('203.0.113.7', 443)",
        "socket.getaddrinfo 'api.anthropic.com'",
    ]
