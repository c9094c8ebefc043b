"""Is an address one of this host's own? (How the agent finds its node without a node id.)"""

from __future__ import annotations

import socket

# Binding to these succeeds on every host, so they say nothing about which node this is.
_WILDCARDS = {"0.0.0.0", "::", ""}


def is_local_address(host: str) -> bool:
    """True when ``host`` (an IP or a name) resolves to an address this host can bind."""
    if host in _WILDCARDS:
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                # Only a local address can be bound; port 0 takes nothing from anyone.
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
                return True
            except OSError:
                continue
    return False
