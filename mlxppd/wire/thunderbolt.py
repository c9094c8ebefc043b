"""The ``thunderbolt`` backend: TCP pinned to a macOS Thunderbolt Bridge interface.

Two Apple Silicon hosts cabled with Thunderbolt get a ``bridgeN`` interface whose members are the
Thunderbolt ports. It carries IP only once it has a routable address (macOS leaves it on a
169.254/16 self-assigned one by default), so the backend insists on a routable IPv4 address,
listens on it and sends from it. Elsewhere choosing this backend is a configuration error.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import subprocess
import sys
from collections.abc import Callable

from mlxppd.core.errors import ConfigurationError
from mlxppd.wire.protocol_stream import ProtocolByteStream
from mlxppd.wire.stats import WireStats
from mlxppd.wire.streams import ByteStream
from mlxppd.wire.tcp import TcpTransport
from mlxppd.wire.transport import Binding, WireConfig

__all__ = ["ThunderboltTransport", "bridge_addresses"]

_KEY = "cluster.transport_backend"
_IFACE_RE = re.compile(r"^(\S+?):\s+flags=")
_INET_RE = re.compile(r"^\s+inet\s+(\d+\.\d+\.\d+\.\d+)\b")
_MEMBER_RE = re.compile(r"^\s+member:\s+(\S+)")


def bridge_addresses(ifconfig_text: str) -> list[tuple[str, str]]:
    """``(interface, ipv4)`` of every bridge with member ports and a routable IPv4 (pure)."""
    blocks: list[tuple[str, list[str], int]] = []  # (interface, IPv4 addresses, member count)
    for line in ifconfig_text.splitlines():
        if m := _IFACE_RE.match(line):
            blocks.append((m.group(1), [], 0))
        elif blocks and (m := _INET_RE.match(line)):
            blocks[-1][1].append(m.group(1))
        elif blocks and _MEMBER_RE.match(line):
            name, inets, members = blocks[-1]
            blocks[-1] = (name, inets, members + 1)
    found = []
    for name, inets, members in blocks:
        if not (name.startswith("bridge") and members):
            continue
        for ip in inets:
            try:
                addr = ipaddress.IPv4Address(ip)
            except ValueError:
                continue
            # macOS self-assigns 169.254/16 to an unconfigured bridge: not routable.
            if not (addr.is_link_local or addr.is_loopback or addr.is_unspecified):
                found.append((name, ip))
    return found


def _run_ifconfig() -> str:
    return subprocess.run(
        ["/sbin/ifconfig"], capture_output=True, text=True, check=False, timeout=10
    ).stdout


class ThunderboltTransport(TcpTransport):
    """TCP over the Thunderbolt Bridge; constructing it off macOS is a ConfigurationError."""

    backend = "thunderbolt"

    def __init__(
        self,
        config: WireConfig,
        *,
        stats: WireStats | None = None,
        platform_name: str = sys.platform,
        ifconfig: Callable[[], str] = _run_ifconfig,
    ):
        if platform_name != "darwin":
            raise ConfigurationError(
                f"transport_backend 'thunderbolt' needs macOS with a Thunderbolt Bridge, and "
                f'this host runs {platform_name}; set transport_backend = "tcp" (or "rdma")',
                key=_KEY,
            )
        super().__init__(config, stats=stats)
        self._ifconfig = ifconfig

    def bridge_address(self) -> str:
        """The routable IPv4 address of the Thunderbolt Bridge."""
        found = bridge_addresses(self._ifconfig())
        if not found:
            raise ConfigurationError(
                "no Thunderbolt Bridge interface with a routable IPv4 address; connect the "
                "cable and give 'Thunderbolt Bridge' a manual IPv4 address in System Settings > "
                'Network, or set transport_backend = "tcp"',
                key=_KEY,
            )
        return found[0][1]

    async def _bind(self, host: str, port: int, on_stream: Callable[[ByteStream], None]) -> Binding:
        ip = self.bridge_address()
        if host not in ("", "0.0.0.0", "::", ip):
            raise ConfigurationError(
                f"listen address {host} is not the Thunderbolt Bridge address {ip}; listen on "
                f"{ip} or 0.0.0.0",
                key=_KEY,
            )
        return await super()._bind(ip, port, on_stream)

    async def _open(self, host: str, port: int) -> ByteStream:
        loop = asyncio.get_running_loop()
        _, stream = await loop.create_connection(
            ProtocolByteStream, host, port, local_addr=(self.bridge_address(), 0)
        )
        return stream
