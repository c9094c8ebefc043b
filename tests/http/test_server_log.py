"""What aiohttp's server refuses itself is counted by reason and summarized, never a traceback
per request (``mlxppd/app/http_server_log.py``); a real listener on loopback and raw sockets."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from aiohttp import http_exceptions, web

from mlxppd.app.http_server_log import (
    BAD_METHOD,
    CLIENT_RESET,
    MALFORMED,
    SERVER_ERROR,
    TOO_LONG,
    ServerLog,
    rejection_reason,
)
from mlxppd.app.http_site import start_site


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (http_exceptions.BadHttpMessage("Duplicate 'Host' header found."), MALFORMED),
        (http_exceptions.BadHttpMethod("PRI"), BAD_METHOD),
        (http_exceptions.LineTooLong("header", "8190", "9000"), TOO_LONG),
        (ConnectionResetError(), CLIENT_RESET),
        (RuntimeError("a bug"), SERVER_ERROR),
        (None, SERVER_ERROR),
    ],
)
def test_each_refusal_has_its_reason(exc: BaseException | None, reason: str) -> None:
    assert rejection_reason(exc) == reason


def test_a_burst_is_one_line_then_one_summary_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    counted: list[str] = []
    server_log = ServerLog(counted.append, interval_s=10.0, clock=lambda: now[0])
    bad = http_exceptions.BadHttpMessage("Duplicate 'Host' header found.\nforged line")
    with caplog.at_level(logging.INFO, logger="mlxppd.http"):
        for _ in range(500):
            server_log.exception("Error handling request from %s", "127.0.0.1", exc_info=bad)
        now[0] = 10.5
        server_log.exception("Error handling request from %s", "127.0.0.1", exc_info=bad)
    assert counted == [MALFORMED] * 501
    assert server_log.seen == {MALFORMED: 501}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("http: refused 1 malformed_request")
    assert lines[1].startswith("http: refused 500 malformed_request")
    assert all("\n" not in line and "forged line" in line for line in lines)  # escaped, one line
    assert not any(r.exc_info for r in caplog.records)


def test_a_server_error_keeps_its_traceback_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server_log = ServerLog(interval_s=10.0, clock=lambda: 0.0)
    with caplog.at_level(logging.INFO, logger="mlxppd.http"):
        for _ in range(3):
            server_log.exception("Unhandled exception", exc_info=RuntimeError("a bug"))
    assert len(caplog.records) == 1 and caplog.records[0].exc_info is not None


def test_a_listener_counts_duplicate_hosts_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> ServerLog:
        async def ok(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/", ok)
        server_log = ServerLog()
        runner, port = await start_site(app, "127.0.0.1", 0, server_log=server_log)
        try:

            def send() -> bytes:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
                    return sock.recv(64)

            for _ in range(50):
                answer = await asyncio.to_thread(send)
                assert answer.split(b" ", 2)[1] == b"400"
        finally:
            await runner.cleanup()
        return server_log

    with caplog.at_level(logging.DEBUG):
        server_log = asyncio.run(scenario())
    assert server_log.seen == {MALFORMED: 50}
    assert not any(r.exc_info for r in caplog.records)
    assert not any(r.name == "aiohttp.server" for r in caplog.records)
    assert sum("malformed_request" in r.getMessage() for r in caplog.records) == 1
