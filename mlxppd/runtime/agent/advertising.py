"""The DNS-SD advertisement an agent keeps (the ``Advertise``/``StopAdvertising`` actions).

A node advertises on the interface of its address in the cluster TOML, so that it is found
where the cluster talks, and never on loopback (a loopback cluster has nobody to find it). An
address that is a name is resolved; an IPv6 one advertises on every interface. What it says
(free memory, accelerator, version) is signed again at every refresh
(``runtime/system/dnssd.py``). A failure to advertise (multicast DNS blocked) is one warning:
the node serves all the same, and the UDP beacon and static peers still find it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable

from mlxppd import __version__
from mlxppd.core.agent.plan import AdvertTarget
from mlxppd.core.log_text import escape
from mlxppd.runtime.system.dnssd import DnssdAdvertiser
from mlxppd.runtime.system.host_addresses import is_local_address
from mlxppd.wire.dnssd_advert import Advert, advert_key

log = logging.getLogger("mlxppd.agent")


def accelerator() -> str:
    """What this host computes on, as an advertisement says it."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def advertised_interfaces(host: str) -> list[str] | None:
    """The interface addresses to advertise ``host`` on: ``[]`` for none (loopback, or not
    this host's), None for every interface (an IPv6 address)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return []
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        if ipaddress.ip_address(address.split("%")[0]).is_loopback:
            continue
        if family == socket.AF_INET6:
            return None
        if address not in out and is_local_address(address):
            out.append(address)
    return out


class NodeAdvert:
    def __init__(
        self,
        free_memory: Callable[[], int | None],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._free_memory = free_memory
        self._clock = clock
        #: what the agent asked for last (what ``observed`` reports, advertised or not)
        self.target: AdvertTarget | None = None
        self._advertiser: DnssdAdvertiser | None = None

    async def advertise(self, target: AdvertTarget, secret: bytes) -> None:
        await self.stop()
        self.target = target
        interfaces = advertised_interfaces(target.host)
        if interfaces == []:
            log.info(
                "agent: not advertised on DNS-SD: %s is loopback or not this host's",
                escape(target.host),
            )
            return
        kind = accelerator()

        def now() -> Advert:
            return Advert(
                target.node_id, target.cluster, target.port, self._free_memory() or 0, kind,
                __version__, int(self._clock()),
            )  # fmt: skip

        advertiser = DnssdAdvertiser(now, advert_key(secret), interfaces=interfaces)
        try:
            await advertiser.start()
        except Exception as exc:  # OSError, zeroconf's own: multicast DNS is not to be had
            log.warning(
                "agent: advertising on DNS-SD failed (%s); the node serves all the same, and "
                "static peers or the UDP beacon find it",
                escape(str(exc)),
            )
            return
        self._advertiser = advertiser

    async def stop(self) -> None:
        self.target = None
        if self._advertiser is not None:
            advertiser, self._advertiser = self._advertiser, None
            await advertiser.close()
