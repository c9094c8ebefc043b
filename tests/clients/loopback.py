"""Holds the client packages to loopback while their tests run.

A CPython audit hook sees every connect, sendto and name lookup Python code makes, in every
thread, whatever HTTP stack a package uses (httpx, httpx2, aiohttp, requests). While a guard is
on, one to anywhere but the loopback range (or a Unix socket) is refused before a packet leaves
and remembered, so a package that swallows the error (telemetry usually does) still fails its
module. Nothing here sends traffic; name lookups of ``localhost`` are the only ones let through.
"""

from __future__ import annotations

import ipaddress
import sys
from typing import Any

#: the audit events by which Python code reaches another host: (event, index of the target)
_TARGET_ARG = {
    "socket.connect": 1,
    "socket.sendto": 1,
    "socket.sendmsg": 1,
    "socket.getaddrinfo": 0,
    "socket.gethostbyname": 0,
    "socket.gethostbyname_ex": 0,
    "socket.gethostbyaddr": 0,
}
_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_local(target: Any) -> bool:
    """True for a loopback address, ``localhost``, a Unix socket path, or no host at all."""
    host = target[0] if isinstance(target, tuple) and target else target
    if host is None or isinstance(host, bytes | bytearray):
        return True  # getaddrinfo(None, port) is a local lookup; bytes are a Unix socket path
    if not isinstance(host, str):
        return False
    if host.lower() in _LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        # Not an IP: a Unix socket's path (a tuple target with a name is a host to look up).
        return not isinstance(target, tuple) and host.startswith(("/", "\0"))


class LoopbackGuard:
    """One per process: ``sys.addaudithook`` cannot be undone, so the hook stays and is off
    between the client modules (other tests reach their namespaced test hosts)."""

    def __init__(self) -> None:
        self.on = False
        #: what was refused while on, as "event target"
        self.refused: list[str] = []
        #: the loopback targets connected to while on
        self.connected: list[Any] = []
        self._installed = False

    def reached(self, url: str) -> bool:
        """True when a connection went to ``url``'s port while on: the hook sees the
        transport that made it."""
        port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        return any(isinstance(t, tuple) and len(t) > 1 and t[1] == port for t in self.connected)

    def install(self) -> None:
        if not self._installed:
            sys.addaudithook(self._hook)
            self._installed = True

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        index = _TARGET_ARG.get(event)
        if index is None or not self.on or len(args) <= index:
            return
        target = args[index]
        if is_local(target):
            if event == "socket.connect":
                self.connected.append(target)
            return
        self.refused.append(f"{event} {target!r}")
        raise ConnectionRefusedError(
            f"the client-compatibility tests are loopback-only: {event} to {target!r} refused"
        )


GUARD = LoopbackGuard()
