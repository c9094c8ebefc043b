"""Node addresses: parsing ``host:port`` (IPv6 in brackets), telling two apart, joining."""

from __future__ import annotations

import ipaddress
import re

_HOST_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_ADDRESS_FORM = (
    "'host:port' (e.g. '192.168.1.11:19001', '[fe80::1]:19001' or 'studio-a.local:19001')"
)


def parse_address(text: str) -> tuple[str, int]:
    """Split "host:port" (IPv4, [IPv6]:port or a hostname) into (host, port); ValueError if bad."""
    bad = f"address '{text}' is not of the form {_ADDRESS_FORM}"
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or not text[close + 1 :].startswith(":"):
            raise ValueError(bad)
        host, port_text = text[1:close], text[close + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"'{host}' in address '{text}' is not an IPv6 address; {bad}"
            ) from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"address '{text}' has no port; write it as {_ADDRESS_FORM}")
        if ":" in host:
            raise ValueError(f"put an IPv6 host in brackets, like '[{host}]:{port_text}'")
        if not host:
            raise ValueError(f"address '{text}' has no host; write it as {_ADDRESS_FORM}")
        if re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ValueError(f"'{host}' in address '{text}' is not an IPv4 address") from None
        elif len(host) > 253 or not all(_HOST_LABEL_RE.fullmatch(x) for x in host.split(".")):
            raise ValueError(f"'{host}' in address '{text}' is not a valid hostname; {bad}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"port '{port_text}' in address '{text}' must be a number from 1 to 65535")
    if host == "0.0.0.0" or (":" in host and ipaddress.IPv6Address(host).is_unspecified):
        # Peers connect to this address, so a wildcard bind address cannot work here.
        raise ValueError(f"address '{text}' is a wildcard; give the address other nodes connect to")
    return host, int(port_text)


def address_key(address: str) -> tuple[str, int]:
    """The identity of a node address, for telling two apart: hostnames are case-insensitive
    and IPv6 has one canonical spelling. ValueError as ``parse_address``."""
    host, port = parse_address(address)
    return (str(ipaddress.ip_address(host)) if ":" in host else host.lower(), port)


def split_host_port(text: str) -> tuple[str, int] | None:
    """(host, port) of a bind address, ``host:port`` or ``[v6]:port``; wildcards and port 0
    are allowed, and the host is not checked. None when ``text`` does not end in ``:digits``."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return (host[1:-1] if host.startswith("[") and host.endswith("]") else host), int(port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (the inverse of ``parse_address``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
