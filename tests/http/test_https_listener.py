"""``start_site`` with a TLS context, the listener every node serves HTTP on (no model): a
client that trusts the certificate gets answers over TLS 1.3, several requests share one
kept-alive connection, a server-sent-event stream arrives event by event, and a plain-HTTP
client on the same port gets no answer. The guard's deadlines still hold above TLS: a client
that completes the handshake but sends no request head is closed."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from mlxppd.app.http_site import HttpGuardStats, HttpLimits, server_context
from mlxppd.core.config.tls import TlsFiles
from mlxppd.http.sse import SseWriter
from tests.support.http import LoopThread
from tests.support.tls import TlsPair, assert_plain_http_gets_no_answer, write_pair

EVENTS = 5


async def _hello(request: web.Request) -> web.Response:
    return web.json_response({"path": request.path, "secure": request.secure})


async def _events(request: web.Request) -> web.StreamResponse:
    sse = await SseWriter.open(request, {})
    for i in range(EVENTS):
        await sse.event({"n": i})
        await asyncio.sleep(0.01)  # separate writes: each event its own TLS record
    await sse.done()
    return sse.response


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TlsPair:
    return write_pair(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def served(pair: TlsPair) -> Iterator[tuple[str, HttpGuardStats]]:
    app = web.Application()
    app.router.add_get("/hello", _hello)
    app.router.add_get("/events", _events)
    loop = LoopThread("https-listener-test")
    stats = HttpGuardStats()
    limits = HttpLimits(header_timeout_s=0.5)
    try:
        yield (
            loop.serve(app, limits, stats, tls=server_context(TlsFiles(pair.cert, pair.key))),
            stats,
        )
    finally:
        loop.stop()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_requests_share_one_kept_alive_tls_connection(
    served: tuple[str, HttpGuardStats], pair: TlsPair
) -> None:
    url, _ = served
    assert url.startswith("https://")
    conn = http.client.HTTPSConnection("127.0.0.1", _port(url), context=pair.client_context())
    try:
        conn.request("GET", "/hello")
        first = conn.getresponse()
        assert json.loads(first.read()) == {"path": "/hello", "secure": True}
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket) and sock.version() == "TLSv1.3"
        assert sock.selected_alpn_protocol() in (None, "http/1.1")
        for _ in range(3):
            conn.request("GET", "/hello")
            assert conn.getresponse().read()
            assert conn.sock is sock  # the same connection: kept alive, not reopened
    finally:
        conn.close()


def test_a_tls_1_2_client_is_served(served: tuple[str, HttpGuardStats], pair: TlsPair) -> None:
    context = pair.client_context()
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    conn = http.client.HTTPSConnection("127.0.0.1", _port(served[0]), context=context)
    try:
        conn.request("GET", "/hello")
        assert conn.getresponse().status == 200
        assert isinstance(conn.sock, ssl.SSLSocket) and conn.sock.version() == "TLSv1.2"
    finally:
        conn.close()


def test_server_sent_events_stream_over_tls(
    served: tuple[str, HttpGuardStats], pair: TlsPair
) -> None:
    conn = http.client.HTTPSConnection("127.0.0.1", _port(served[0]), context=pair.client_context())
    try:
        conn.request("GET", "/events")
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type", "").startswith("text/event-stream")
        lines = [response.readline() for _ in range(2 * EVENTS + 2)]
    finally:
        conn.close()
    data = [line for line in lines if line.startswith(b"data: ")]
    assert data == [b'data: {"n":%d}\n' % i for i in range(EVENTS)] + [b"data: [DONE]\n"]


def test_plain_http_on_the_tls_port_gets_no_answer(served: tuple[str, HttpGuardStats]) -> None:
    assert_plain_http_gets_no_answer(_port(served[0]))


def test_an_untrusted_client_is_refused_at_the_handshake(
    served: tuple[str, HttpGuardStats],
) -> None:
    conn = http.client.HTTPSConnection("127.0.0.1", _port(served[0]), timeout=10)
    with pytest.raises(ssl.SSLCertVerificationError):
        conn.request("GET", "/hello")
    conn.close()


def test_a_silent_client_after_the_handshake_is_closed(
    served: tuple[str, HttpGuardStats], pair: TlsPair, tmp_path: Path
) -> None:
    url, stats = served
    before = stats.closed_head_timeout
    raw = socket.create_connection(("127.0.0.1", _port(url)), timeout=10)
    with pair.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        # No request head: the guard's header deadline (0.5 s here) closes the connection.
        assert tls.recv(1) == b""
    assert stats.closed_head_timeout == before + 1
