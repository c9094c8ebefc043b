"""What aiohttp's server says about the requests it refuses itself, counted and summarized.

aiohttp's connection handler logs a request it cannot parse (a duplicate ``Host``, a header
line too long, a method that is no method) and a handler failure it catches as an ERROR
traceback on ``aiohttp.server``: a client sending a few bytes at will wrote ~20x as many to the
log. Every listener here hands it a ``ServerLog`` instead (``app/http_site.py``): each such event
is counted by reason (``mlxpp_http_rejected_total{reason}``) and becomes at most one escaped
line per reason every ``interval_s`` seconds, with the count since the last one and the last
event's detail. A failure that is not the client's (a bug) keeps its traceback, as rarely.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import http_exceptions

from mlxppd.core.log_text import escape
from mlxppd.core.log_throttle import LogThrottle

log = logging.getLogger("mlxppd.http")

#: why aiohttp refused a request, the label of ``mlxpp_http_rejected_total``
MALFORMED = "malformed_request"
BAD_METHOD = "bad_method"
TOO_LONG = "header_too_long"
CLIENT_RESET = "client_reset"
SERVER_ERROR = "server_error"


def rejection_reason(exc: BaseException | None) -> str:
    """The reason label of what aiohttp reports: the client's fault, or the server's."""
    if isinstance(exc, http_exceptions.BadHttpMethod):
        return BAD_METHOD
    if isinstance(exc, http_exceptions.LineTooLong):
        return TOO_LONG
    if isinstance(exc, http_exceptions.HttpProcessingError):
        return MALFORMED
    if isinstance(exc, ConnectionError):
        return CLIENT_RESET
    return SERVER_ERROR


def _detail(exc: BaseException | None) -> str:
    """One escaped line of what went wrong (aiohttp's messages span lines)."""
    if exc is None:
        return "-"
    if isinstance(exc, http_exceptions.HttpProcessingError):
        text = exc.message if isinstance(exc.message, str) else str(exc.message)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return escape(" ".join(text.split()), 200)


@dataclass
class ServerLog:
    """Stands in for aiohttp's ``server_logger`` (``RequestHandler(logger=...)``): aiohttp
    calls ``exception`` for what it refused or caught, ``debug`` for what it shrugs off."""

    #: counts one rejection by reason (the app's metrics; None: not counted there)
    count: Callable[[str], None] | None = None
    interval_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    #: rejections seen, by reason (the listener's own tally, for tests and stats)
    seen: dict[str, int] = field(default_factory=dict)
    _throttles: dict[str, LogThrottle] = field(default_factory=dict)

    def exception(self, msg: object, *args: object, exc_info: Any = None, **kw: Any) -> None:
        self._reject(exc_info if isinstance(exc_info, BaseException) else None, args)

    def error(self, msg: object, *args: object, exc_info: Any = None, **kw: Any) -> None:
        self._reject(exc_info if isinstance(exc_info, BaseException) else None, args)

    def debug(self, msg: object, *args: object, exc_info: Any = None, **kw: Any) -> None:
        # aiohttp's debug lines come only with the loop's debug mode, but for a bad method on a
        # connection's first request, which is a rejection like any other.
        if isinstance(exc_info, BaseException):
            self._reject(exc_info, args)

    def warning(self, msg: object, *args: object, **kw: Any) -> None:
        log.warning("aiohttp: %s", escape(str(msg) % args if args else str(msg), 300))

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging.Logger's name
        return log.isEnabledFor(level)

    def _reject(self, exc: BaseException | None, args: tuple[object, ...]) -> None:
        reason = rejection_reason(exc)
        self.seen[reason] = self.seen.get(reason, 0) + 1
        if self.count is not None:
            self.count(reason)
        throttle = self._throttles.setdefault(reason, LogThrottle(self.interval_s, self.clock))
        if (counts := throttle.note(reason)) is None:
            return
        peer = escape(str(args[0]), 64) if args else "-"
        line = "http: refused %s request(s) since the last such line (the last from %s: %s)"
        if reason == SERVER_ERROR:
            # Not the client's doing: the traceback is worth its lines, once per interval.
            log.error(line, counts, peer, _detail(exc), exc_info=exc)
        else:
            log.warning(line, counts, peer, _detail(exc))
