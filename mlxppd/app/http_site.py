"""Listening with an aiohttp application: one way, whoever puts the node together.

aiohttp bounds what one request may send (header sizes, ``client_max_size``) but not how many
connections a client may hold open or how slowly it may send or read. Every listener here bounds
every phase of every connection, whatever the path (``HttpLimits``): past ``max_connections`` a
new connection gets a 503 and is closed; a request head must arrive within
``header_timeout_s``; its body within ``body_timeout_s`` of the head (a handler reading it then
gets ``BodyDeadline``, a ``TimeoutError``: a 408, and the connection closes after the answer); a
response the client stops reading is cut ``write_timeout_s`` after the transport's buffer
filled; an idle keep-alive connection closes after ``keepalive_timeout_s``; an answered
request's unread body is read and dropped for ``linger_s``, then the connection closes. A
request being handled is never cut for taking its time. What is cut is counted
(``HttpGuardStats``, and the app's metrics when it has them) and never logged as a traceback.

With a ``tls`` context the listener serves HTTPS (``mlxppd.core.config.tls``): the guard sits
above the TLS layer, so every deadline above counts decrypted bytes, and the handshake itself
must finish within ``header_timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields
from typing import Any, cast

from aiohttp import streams, web

from mlxppd.app.http_server_log import ServerLog
from mlxppd.core.config.addresses import join_host_port
from mlxppd.core.config.tls import MAKE_ONE, TlsFiles, check_tls_files
from mlxppd.core.errors import ConfigurationError
from mlxppd.http.base_app import BodyDeadline, cut_counter, note_listener, rejected_counter

__all__ = [
    "BodyDeadline",
    "HttpGuardStats",
    "HttpLimits",
    "http_url",
    "server_context",
    "start_site",
]

log = logging.getLogger("mlxppd.http")


@dataclass(frozen=True)
class HttpLimits:
    """What one listener allows its clients."""

    #: connections open at once; one more gets a 503 with Retry-After and is closed
    max_connections: int = 1024
    #: seconds a request's head may take to arrive (slowloris guard)
    header_timeout_s: float = 10.0
    #: seconds a request's body may take to arrive once its head is in (a 408 after)
    body_timeout_s: float = 30.0
    #: seconds a response may wait on a client that does not read before it is cut
    write_timeout_s: float = 30.0
    #: seconds an idle keep-alive connection stays open between requests
    keepalive_timeout_s: float = 15.0
    #: seconds an answered request's unread body is drained, so its client reads the answer
    #: (an early 401, 413) rather than a reset; then the connection closes
    linger_s: float = 2.0

    def __post_init__(self) -> None:
        for item in fields(self):
            if not (value := getattr(self, item.name)) > 0:
                raise ValueError(f"HttpLimits.{item.name} must be a positive number, not {value}")


@dataclass
class HttpGuardStats:
    """Connections a listener turned away or cut, by reason (counted, and logged at debug)."""

    refused_over_capacity: int = 0
    closed_head_timeout: int = 0
    closed_body_timeout: int = 0
    closed_write_timeout: int = 0
    closed_idle: int = 0


@dataclass
class _Guard:
    limits: HttpLimits
    stats: HttpGuardStats = field(default_factory=HttpGuardStats)
    open: dict[asyncio.BaseTransport, _GuardedConnection] = field(default_factory=dict)
    #: the app's metrics counter of cut connections, by reason (None: the app has none)
    metric: Callable[[str], None] | None = None

    def count(self, stat: str, reason: str) -> None:
        setattr(self.stats, stat, getattr(self.stats, stat) + 1)
        if self.metric is not None:
            self.metric(reason)


class _GuardedConnection(asyncio.Protocol):
    """Stands in front of aiohttp's request handler and closes a connection that dawdles."""

    def __init__(self, inner: asyncio.Protocol, guard: _Guard) -> None:
        self._inner = inner
        self._guard = guard
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None  # head, body or idle: one at a time
        self._write_timer: asyncio.TimerHandle | None = None
        self._busy = False  # a request's head has arrived and it is being handled
        self._head_started = False  # bytes of the next request's head have arrived

    # -- what the middleware tells -------------------------------------------------------------

    def request_started(self, body: streams.StreamReader) -> None:
        self._busy = True
        self._cancel()
        if not body.is_eof():
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(
                self._guard.limits.body_timeout_s, self._body_expired, body
            )

    def request_finished(self) -> None:
        self._busy = False
        self._head_started = False
        self._arm(self._guard.limits.keepalive_timeout_s, idle=True)

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but they behave as such.
        self._transport = cast(asyncio.Transport, transport)
        self._guard.open[transport] = self
        self._arm(self._guard.limits.header_timeout_s, idle=False)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy and not self._head_started:
            self._head_started = True  # the head of the next request: its own deadline
            self._arm(self._guard.limits.header_timeout_s, idle=False)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._cancel_write()
        if self._transport is not None:
            self._guard.open.pop(self._transport, None)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        # The transport's buffer is full: the client has this long to read some of it.
        self._cancel_write()
        loop = asyncio.get_running_loop()
        self._write_timer = loop.call_later(self._guard.limits.write_timeout_s, self._write_expired)
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._cancel_write()
        self._inner.resume_writing()

    # -- the deadlines -------------------------------------------------------------------------

    def _arm(self, seconds: float, *, idle: bool) -> None:
        self._cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(seconds, self._expired, idle)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cancel_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _expired(self, idle: bool) -> None:
        self._timer = None
        if self._busy or self._transport is None:
            return
        if idle:
            self._guard.stats.closed_idle += 1
        else:
            self._guard.count("closed_head_timeout", "head_timeout")
            log.debug("http: closing a connection whose request head did not arrive in time")
        self._transport.close()

    def _body_expired(self, body: streams.StreamReader) -> None:
        self._timer = None
        if body.is_eof() or self._transport is None:
            return
        self._guard.count("closed_body_timeout", "body_timeout")
        seconds = self._guard.limits.body_timeout_s
        # A handler reading the body gets this (its 408); one that does not keeps running, and
        # the connection closes once it has answered (aiohttp's handler: no further requests).
        body.set_exception(BodyDeadline(f"the request body did not arrive within {seconds:g} s"))
        close_after_answer = getattr(self._inner, "close", None)
        if close_after_answer is not None:
            close_after_answer()

    def _write_expired(self) -> None:
        self._write_timer = None
        if self._transport is None:
            return
        self._guard.count("closed_write_timeout", "write_timeout")
        log.debug("http: cutting a connection whose client stopped reading")
        # abort, not close: close would wait for the unread buffer to drain, which it will not.
        self._transport.abort()


class _AtCapacity(asyncio.Protocol):
    """Answers one 503 and closes: the listener holds as many connections as it allows."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        body = json.dumps(
            {
                "error": {
                    "message": "the server holds as many connections as it allows; retry shortly",
                    "type": "server_overloaded",
                    "param": None,
                    "code": "too_many_connections",
                }
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        transport.write(head.encode() + body)
        # Closing at once would reset the connection under the client's unread request, and
        # it might never see the 503; half-close, then close when it does (or after a second).
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(1.0, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read: its answer is already on its way

    def eof_received(self) -> bool:
        return False  # the client is done: close now


class _GuardedSite(web.TCPSite):
    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        guard: _Guard,
        tls: ssl.SSLContext | None,
    ) -> None:
        super().__init__(runner, host, port, ssl_context=tls)
        self._guard = guard
        self._tls = tls

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        guard = self._guard

        def connection() -> asyncio.Protocol:
            if len(guard.open) >= guard.limits.max_connections:
                guard.count("refused_over_capacity", "over_capacity")
                return _AtCapacity()
            return _GuardedConnection(server(), guard)

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            connection,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            ssl=self._tls,
            # A handshake that dawdles holds a connection as a slow request head would.
            ssl_handshake_timeout=guard.limits.header_timeout_s if self._tls else None,
        )


def _middleware(guard: _Guard) -> Any:
    @web.middleware
    async def track(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        connection = guard.open.get(request.transport) if request.transport else None
        if connection is not None:
            connection.request_started(request.content)
        try:
            return await handler(request)
        finally:
            if connection is not None:
                connection.request_finished()

    return track


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    limits: HttpLimits | None = None,
    stats: HttpGuardStats | None = None,
    tls: ssl.SSLContext | None = None,
    server_log: ServerLog | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` within ``limits``, counting what it turns away into
    ``stats``, over TLS with ``tls``; the requests aiohttp refuses itself go to ``server_log``
    (a new one counting into the app's metrics by default: ``app/http_server_log.py``).
    Returns its runner (``cleanup()`` stops it) and the port bound (port 0 asks the OS)."""
    guard = _Guard(limits or HttpLimits(), stats or HttpGuardStats(), metric=cut_counter(app))
    app.middlewares.insert(0, _middleware(guard))
    note_listener(app, host)
    runner = web.AppRunner(
        app,
        access_log=None,  # the base app logs each request once, escaped (http/base_app.py)
        logger=server_log or ServerLog(rejected_counter(app)),
        keepalive_timeout=guard.limits.keepalive_timeout_s,
        lingering_time=guard.limits.linger_s,
    )
    await runner.setup()
    site = _GuardedSite(runner, host, port, guard, tls)
    await site.start()
    server: Any = site._server
    sockets = server.sockets if server is not None else []
    return runner, int(sockets[0].getsockname()[1]) if sockets else port


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The TLS context of a listener serving ``files``: TLS 1.2 minimum (1.3 whenever the client
    offers it: OpenSSL picks the highest both speak), HTTP/1.1; a bad file is a
    ConfigurationError naming it and the fix."""
    check_tls_files(files)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        # ssl reads only from paths: the files just checked, read again (no passphrase prompt).
        context.load_cert_chain(files.cert, files.key, password=_no_passphrase)
    except (ssl.SSLError, OSError, ConfigurationError) as exc:
        raise ConfigurationError(
            f"OpenSSL refused the TLS certificate {files.cert} with the key {files.key} "
            f"({getattr(exc, 'reason', None) or exc}); check both files ({MAKE_ONE})"
        ) from None
    return context


def _no_passphrase() -> str:
    raise ConfigurationError("the key is encrypted")


def http_url(host: str, port: int, *, tls: bool = False) -> str:
    """The listener's base URL: https:// when it serves TLS."""
    return f"{'https' if tls else 'http'}://{join_host_port(host, port)}"
