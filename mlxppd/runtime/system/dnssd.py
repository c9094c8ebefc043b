"""DNS-SD on multicast DNS through python-zeroconf: a node's advertisement, and a browser that
believes only signed ones (``wire/dnssd_advert.py``).

An agent advertises ``<node id>.<cluster>._mlxpp._tcp.local.`` on every interface, IPv4 and
IPv6 (link-local addresses included, with their scope), pointing at its control port, and
signs it again every ``refresh_s`` with its free memory then. ``browse`` (``mlxppctl
discover``) listens for ``timeout_s`` and resolves what it heard; an advertisement whose MAC,
cluster or age does not hold is ignored, counted by reason and logged escaped, at most one
line per reason every 10 s. Where multicast DNS is blocked, the signed UDP beacon
(``wire/discovery.py``) and static peers remain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxppd.core.log_text import escape
from mlxppd.core.log_throttle import LogThrottle
from mlxppd.wire.dnssd_advert import (
    SERVICE_TYPE,
    Advert,
    AdvertRejected,
    advert_properties,
    instance_name,
    verify_advert,
)

if TYPE_CHECKING:
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger("mlxppd.dnssd")

#: seconds between two signatures of a node's advertisement (well within its believable age)
DEFAULT_REFRESH_S = 30.0
#: the most services one browse resolves: a flood of names costs no more than this
MAX_SERVICES = 256


@dataclass(frozen=True)
class Found:
    """A node seen on the link, its advertisement verified."""

    advert: Advert
    #: the addresses its record gives, IPv6 link-local ones with their scope ("fe80::1%eth0")
    addresses: tuple[str, ...]


@dataclass
class BrowseResult:
    found: list[Found] = field(default_factory=list)
    #: advertisements ignored, by reason (bad_mac, stale, foreign, malformed, ...)
    ignored: Counter[str] = field(default_factory=Counter)


class DnssdAdvertiser:
    """One node's advertisement, kept fresh until closed."""

    def __init__(
        self,
        advert: Callable[[], Advert],
        key: bytes,
        *,
        interfaces: list[str] | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
    ) -> None:
        """``advert()`` says what to advertise now; ``interfaces``: addresses to listen and
        answer on (None: every interface, IPv4 and IPv6)."""
        self._advert = advert
        self._key = key
        self._interfaces = interfaces
        self._refresh_s = refresh_s
        self._zc: AsyncZeroconf | None = None
        self._task: asyncio.Task[None] | None = None

    def _info(self) -> AsyncServiceInfo:
        from zeroconf.asyncio import AsyncServiceInfo

        advert = self._advert()
        name = instance_name(advert.node_id, advert.cluster)
        return AsyncServiceInfo(
            SERVICE_TYPE,
            name,
            port=advert.port,
            properties=advert_properties(advert, self._key),
            server=f"{advert.node_id}-{advert.cluster}.local.",
            # An AAAA record holds no scope: a receiver adds the interface it heard it on.
            parsed_addresses=[a.split("%")[0] for a in _local_addresses(self._interfaces)],
        )

    async def start(self) -> None:
        from zeroconf import InterfaceChoice, IPVersion
        from zeroconf.asyncio import AsyncZeroconf

        zc = AsyncZeroconf(
            interfaces=self._interfaces or InterfaceChoice.All, ip_version=IPVersion.All
        )
        self._zc = zc
        info = self._info()
        await zc.async_register_service(info)
        log.info("dns-sd: advertising %s", escape(info.name))
        self._task = asyncio.create_task(self._refresh(), name="dnssd-refresh")

    async def _refresh(self) -> None:
        while self._zc is not None:
            await asyncio.sleep(self._refresh_s)
            try:
                await self._zc.async_update_service(self._info())
            except Exception as exc:  # the next refresh tries again
                log.warning("dns-sd: refreshing the advertisement failed: %s", exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._zc is not None:
            with contextlib.suppress(Exception):
                await self._zc.async_unregister_all_services()
            await self._zc.async_close()
            self._zc = None


def browse(
    key: bytes,
    cluster: str,
    *,
    timeout_s: float = 3.0,
    interfaces: list[str] | None = None,
    clock: Callable[[], float] = time.time,
) -> BrowseResult:
    """The nodes of ``cluster`` advertising on the link within ``timeout_s`` seconds."""
    from zeroconf import InterfaceChoice, IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

    names: list[str] = []
    lock = threading.Lock()

    def heard(
        zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change is not ServiceStateChange.Removed:
            with lock:
                if name not in names and len(names) < MAX_SERVICES:
                    names.append(name)

    zc = Zeroconf(interfaces=interfaces or InterfaceChoice.All, ip_version=IPVersion.All)
    result = BrowseResult()
    throttle = LogThrottle()
    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[heard])
        time.sleep(timeout_s)
        browser.cancel()
        with lock:
            heard_names = list(names)
        for name in heard_names:
            info = zc.get_service_info(SERVICE_TYPE, name, timeout=1500)
            if info is None:
                continue
            try:
                advert = verify_advert(
                    name, info.port or 0, info.properties, key, cluster=cluster, now=clock()
                )
            except AdvertRejected as exc:
                result.ignored[exc.reason] += 1
                if (counts := throttle.note(exc.reason)) is not None:
                    log.warning(
                        "dns-sd: ignored the advertisement %s (%s: %s; ignored so far: %s)",
                        escape(name, 128), exc.reason, escape(str(exc), 128), counts,
                    )  # fmt: skip
                continue
            addresses = tuple(info.parsed_scoped_addresses())
            result.found.append(Found(advert, addresses))
    finally:
        zc.close()
    result.found.sort(key=lambda f: f.advert.node_id)
    return result


def _local_addresses(only: list[str] | None) -> list[str]:
    """This host's addresses (IPv6 link-local ones with their scope), or ``only``."""
    if only:
        return list(only)
    import ifaddr

    out: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, tuple):  # IPv6: (address, flowinfo, scope id)
                address, _, scope = ip.ip
                if address == "::1":
                    continue
                out.append(f"{address}%{scope}" if address.startswith("fe80") else address)
            elif not str(ip.ip).startswith("127."):
                out.append(str(ip.ip))
    return out
