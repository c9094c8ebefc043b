"""Every path of the API app is under the listener's deadlines, and the admin API refuses what
the signature header alone shows to be wrong before it reads a byte of the body.

The real app (``create_app`` with the admin API, no api key) on the nodes' own listener, with
short deadlines injected; raw sockets send the slow and broken requests a hostile client sends.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from mlxppd.app.api_app import api_app
from mlxppd.app.http_site import HttpGuardStats, HttpLimits
from mlxppd.http.admin_api import AdminApi
from mlxppd.http.console_feed import ConsoleFeed
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.wire.admin_auth import AdminVerifier, admin_key
from tests.support.admin_server import CLUSTER, SECRET, IdleBackend, ScriptedCluster
from tests.support.http import LoopThread

#: a body deadline far beyond any wait here: an answer seen sooner did not wait for the body
PATIENT = HttpLimits(body_timeout_s=600, linger_s=0.2)
HASTY = HttpLimits(body_timeout_s=0.3, linger_s=0.2)


class App:
    def __init__(self, limits: HttpLimits) -> None:
        self.loop = LoopThread("deadlines-test")
        self.stats = HttpGuardStats()
        self.metrics = PipelineMetrics(CollectorRegistry())
        self.controller = ScriptedCluster()
        self.failures: list[str] = []
        verifier = AdminVerifier(admin_key(SECRET), cluster_name=CLUSTER, clock=time.time)
        admin = AdminApi(self.controller, verifier, self.failures.append)
        console = ConsoleFeed(self.controller, self.metrics, None)
        app = api_app(IdleBackend(), console, admin=admin, metrics=self.metrics)
        self.url = self.loop.serve(app, limits, self.stats)
        self.port = int(self.url.rsplit(":", 1)[1])

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)

    def cut(self, reason: str) -> float:
        sample = self.metrics.registry.get_sample_value(
            "mlxpp_http_connections_cut_total", {"reason": reason}
        )
        return sample or 0.0


@pytest.fixture
def app(request: pytest.FixtureRequest) -> Iterator[App]:
    running = App(request.param)
    yield running
    running.loop.stop()


def head(
    path: str, length: int, *, auth: str | None = None, port: int = 0, expect: bool = False
) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    if auth is not None:
        lines.append(f"Authorization: {auth}")
    if expect:  # the server says "100 Continue" once the request is routed to its handler
        lines.append("Expect: 100-continue")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def forged() -> str:
    """A signature header well formed and fresh, its MAC made up: only the body can show it."""
    return f"MLXPP-HMAC ts={int(time.time())},nonce={'0' * 32},mac={'0' * 64}"


def answer_of(sock: socket.socket, *, then: bool = True) -> tuple[int, dict[str, Any], bool]:
    """(status, JSON body, whether the server then closed the connection: read on only when
    ``then``, else False)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    top, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(h for h in top.split(b"\r\n") if h.lower().startswith(b"content-length"))
                 .split(b":")[1])  # fmt: skip
    while len(rest) < length:
        rest += sock.recv(65536)
    if not then:
        return int(top.split(b" ")[1]), json.loads(rest[:length]), False
    try:
        closed = sock.recv(1) == b""
    except ConnectionResetError:
        closed = True
    return int(top.split(b" ")[1]), json.loads(rest[:length]), closed


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset, as a client that crashes or is killed does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.parametrize("app", [PATIENT], indirect=True)
def test_an_unsigned_admin_request_is_refused_before_its_body_arrives(app: App) -> None:
    with app.connect() as sock:
        sock.sendall(head("/admin/v1/drain", 60_000, port=app.port) + b"{")
        status, body, closed = answer_of(sock)
    assert status == 401 and body["error"]["code"] == "missing"
    assert closed, "the unread body kept the connection open"
    assert app.failures == ["missing"]
    assert app.controller.admission == "open"


@pytest.mark.parametrize("app", [HASTY], indirect=True)
def test_a_forged_admin_signature_gets_its_body_read_only_within_the_deadline(app: App) -> None:
    with app.connect() as sock:
        sock.sendall(head("/admin/v1/drain", 2_000, auth=forged(), port=app.port) + b"{")
        status, body, closed = answer_of(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert "0.3 s" in str(body["error"]["message"])
    assert closed
    assert app.stats.closed_body_timeout == 1 and app.cut("body_timeout") == 1


@pytest.mark.parametrize("app", [HASTY], indirect=True)
def test_an_api_body_that_stops_arriving_is_a_408_in_the_apis_shape(app: App) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        with app.connect() as sock:
            sock.sendall(head(path, 500, port=app.port) + b'{"prompt": "a')
            status, body, closed = answer_of(sock)
        assert status == 408, body
        assert body["error"]["code"] == "request_timeout" and closed


@pytest.mark.parametrize("app", [HASTY], indirect=True)
def test_the_consoles_plan_body_is_read_whole_and_within_the_deadline(app: App) -> None:
    body = b'{"stages": 2, "stage_memory": "8GiB,8GiB"}'
    with app.connect() as sock:
        sock.sendall(head("/console/v1/plan", len(body), port=app.port) + body[:10])
        time.sleep(0.05)  # the rest comes in a segment of its own
        sock.sendall(body[10:])
        status, answer, _ = answer_of(sock, then=False)
    assert status == 422 and answer["error"]["code"] == "no_plan", answer  # parsed: no model
    with app.connect() as sock:
        sock.sendall(head("/console/v1/plan", len(body), port=app.port) + body[:10])
        status, answer, closed = answer_of(sock)
    assert status == 408 and answer["error"]["code"] == "request_timeout" and closed


@pytest.mark.parametrize("app", [HASTY], indirect=True)
def test_a_route_that_reads_no_body_answers_and_the_connection_closes(app: App) -> None:
    with app.connect() as sock:
        sock.sendall(
            f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{app.port}\r\nContent-Length: 9000\r\n\r\n"
            .encode()
        )  # fmt: skip
        status, body, closed = answer_of(sock)
    assert status == 200 and body["status"] == "ok"
    assert closed, "a body that never came kept the connection open"


@pytest.mark.parametrize("app", [PATIENT], indirect=True)
def test_a_client_that_resets_mid_body_is_one_quiet_line_and_counted(
    app: App, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mlxppd")
    for _ in range(3):
        sock = app.connect()
        sock.sendall(head("/admin/v1/drain", 2_000, auth=forged(), port=app.port, expect=True))
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(b"{")  # the handler reads the body now, and the client goes
        reset(sock)
    deadline = time.monotonic() + 30
    while app.cut("client_reset") < 3:
        assert time.monotonic() < deadline, "the resets were never counted"
        time.sleep(0.02)
    lines = [r for r in caplog.records if "reset the connection" in r.getMessage()]
    assert len(lines) == 3 and all(r.levelno == logging.INFO for r in lines)
    assert not [r for r in caplog.records if r.exc_info], "a reset was logged with a traceback"
