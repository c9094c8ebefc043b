"""What a listener lets an unauthenticated connection have: a slot among a few handshakes.

A connection that has not finished its handshake is anyone's: it gets a small receive buffer
(``streams.HANDSHAKE_BUFFER_BYTES``), ``handshake_timeout_s`` to finish, and one of
``max_handshakes`` slots, at most ``max_handshakes_per_source`` of them per source address (per
/64 for IPv6).
A connection beyond either cap is closed before a byte of it is read, counted in
``WireStats.preauth_refused`` and logged at most once per ``log_interval_s`` (a flood must not
become a flood of log lines).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Callable

from mlxppd.core.log_throttle import LogThrottle
from mlxppd.wire.errors import PreauthRefusal
from mlxppd.wire.streams import ByteStream

__all__ = ["HandshakeGate", "source_of"]

log = logging.getLogger(__name__)


def source_of(host: str) -> str:
    """What per-source caps count by: an IPv4 address, or the /64 of an IPv6 one, since one
    host commonly holds a whole /64 (pure)."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:  # a dual-stack socket's view of an IPv4 peer
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class HandshakeGate:
    """Counts a listener's handshakes in progress, in total and per source host."""

    def __init__(
        self,
        max_handshakes: int,
        max_per_source: int,
        *,
        log_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_handshakes = max_handshakes
        self.max_per_source = max_per_source
        self._holders: dict[ByteStream, str] = {}  # stream -> its source
        self._per_source: Counter[str] = Counter()  # only hosts holding a slot: bounded
        self._log = LogThrottle(log_interval_s, clock)

    @property
    def in_progress(self) -> int:
        """Handshakes holding a slot now."""
        return len(self._holders)

    def in_progress_from(self, host: str) -> int:
        """Handshakes from ``host`` (from its /64, for IPv6) holding a slot now."""
        return self._per_source.get(source_of(host), 0)

    def streams(self) -> tuple[ByteStream, ...]:
        """The connections whose handshake is in progress."""
        return tuple(self._holders)

    def admit(self, stream: ByteStream) -> PreauthRefusal | None:
        """Take a slot for ``stream``; why not when a cap is reached (nothing is taken then)."""
        if len(self._holders) >= self.max_handshakes:
            return PreauthRefusal.HANDSHAKES_IN_PROGRESS
        source = source_of(stream.peer_host)
        if self._per_source[source] >= self.max_per_source:
            return PreauthRefusal.HANDSHAKES_FROM_SOURCE
        self._holders[stream] = source
        self._per_source[source] += 1
        return None

    def release(self, stream: ByteStream) -> None:
        """Give ``stream``'s slot back (its handshake ended, either way); idempotent."""
        source = self._holders.pop(stream, None)
        if source is None:
            return
        self._per_source[source] -= 1
        if self._per_source[source] <= 0:
            del self._per_source[source]

    def note_refusal(self, reason: PreauthRefusal, stream: ByteStream) -> None:
        """Log a refusal, or fold it into the next line when one was logged recently."""
        counts = self._log.note(reason)
        if counts is None:
            return
        log.warning(
            "wire: closed unauthenticated connections before reading them (%s; latest from "
            "%s): at most %d handshakes in progress, %d per source address",
            counts,
            stream.peer,
            self.max_handshakes,
            self.max_per_source,
        )
