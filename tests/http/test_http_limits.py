"""A listener bounds what clients may hold: connections over the cap get a 503, a request head
or body that dawdles (slowloris) or an idle keep-alive connection is closed, a response its
client stops reading is cut, a request being handled is never cut for taking its time. Real
sockets against ``start_site``; deadlines are injected, conditions polled."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
import uvloop
from aiohttp import web

from mlxppd.app.http_site import BodyDeadline, HttpGuardStats, HttpLimits, start_site
from tests.support.http import LoopThread

GET = b"GET /hello HTTP/1.1\r\nHost: test\r\n\r\n"


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


class Server:
    def __init__(self, limits: HttpLimits, loop: str) -> None:
        self.loop = LoopThread("http-limits", LOOPS[loop])
        self.stats = HttpGuardStats()
        self.release = asyncio.Event()
        #: what the handlers saw end their request (a deadline, a cut connection)
        self.seen: list[BaseException] = []

        async def hello(request: web.Request) -> web.Response:
            return web.Response(text="hello")

        async def slow(request: web.Request) -> web.Response:
            await self.release.wait()
            return web.Response(text="done")

        async def echo(request: web.Request) -> web.Response:
            try:
                return web.Response(body=await request.read())
            except TimeoutError as exc:
                self.seen.append(exc)
                return web.Response(status=408, text=str(exc))

        async def flood(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse()
            await response.prepare(request)
            try:
                while True:
                    await response.write(b"x" * 65536)
            except ConnectionError as exc:
                self.seen.append(exc)
            return response

        async def start() -> int:
            app = web.Application()
            app.router.add_get("/hello", hello)
            app.router.add_get("/slow", slow)
            app.router.add_post("/echo", echo)
            app.router.add_get("/flood", flood)
            runner, port = await start_site(app, "127.0.0.1", 0, limits, self.stats)
            self.loop._runners.append(runner)
            return port

        self.port = self.loop.call(start())

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        return sock

    def get(self, path: bytes = b"/hello") -> bytes:
        with self.connect() as sock:
            sock.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server closed the connection (reads EOF or reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_for(condition, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture(params=sorted(LOOPS))
def loop_name(request: pytest.FixtureRequest) -> str:
    """Every test runs on both loops a node may use (uvloop's transports are their own)."""
    return str(request.param)


@pytest.fixture
def server(request: pytest.FixtureRequest, loop_name: str) -> Iterator[Server]:
    limits = getattr(request, "param", HttpLimits())
    running = Server(limits, loop_name)
    yield running
    running.release.set()
    running.loop.stop()


@pytest.mark.parametrize("server", [HttpLimits(max_connections=5)], indirect=True)
def test_a_connection_over_the_cap_gets_a_503_and_a_freed_slot_serves_again(
    server: Server,
) -> None:
    held = [server.connect() for _ in range(5)]
    wait_for(lambda: server.get().startswith(b"HTTP/1.1 503"))
    answer = server.get()
    assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer
    assert b"too_many_connections" in answer
    assert server.stats.refused_over_capacity >= 2
    for sock in held:
        sock.close()
    wait_for(lambda: server.get().endswith(b"hello"))


@pytest.mark.parametrize(
    "server", [HttpLimits(header_timeout_s=0.5, keepalive_timeout_s=60)], indirect=True
)
def test_a_request_head_sent_a_byte_at_a_time_is_cut_off_while_others_are_served(
    server: Server,
) -> None:
    with server.connect() as slow:
        sent = 0
        while not closed_after_send(slow, GET[sent : sent + 1]):
            sent += 1
            assert server.get().endswith(b"hello")  # a normal client is answered meanwhile
            time.sleep(0.1)
            assert sent < len(GET), "the whole head went through"
    assert server.stats.closed_head_timeout == 1


def closed_after_send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        return True
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


@pytest.mark.parametrize(
    "server", [HttpLimits(header_timeout_s=0.3, keepalive_timeout_s=0.3)], indirect=True
)
def test_a_request_being_handled_is_never_cut_and_an_idle_connection_is_closed(
    server: Server,
) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        # Well past both deadlines, the handler still holds the request open.
        wait_for(lambda: server.stats.closed_head_timeout + server.stats.closed_idle == 0)
        time.sleep(1.0)
        assert server.stats.closed_head_timeout + server.stats.closed_idle == 0
        server.loop.call(_set(server.release))
        answer = b""
        while not answer.endswith(b"done"):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
        assert closed_by_peer(sock)  # idle after its answer: the keep-alive ran out
    assert server.stats.closed_idle == 1


async def _set(event: asyncio.Event) -> None:
    event.set()


@pytest.mark.parametrize("server", [HttpLimits(body_timeout_s=0.3)], indirect=True)
def test_a_body_that_stops_arriving_ends_its_read_and_the_connection_closes_after_the_answer(
    server: Server,
) -> None:
    with server.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        answer = read_all(sock)  # the answer, then the server closes: no further request
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"did not arrive within 0.3 s" in answer
    assert [type(e) for e in server.seen] == [BodyDeadline]
    assert server.stats.closed_body_timeout == 1
    assert server.get().endswith(b"hello")


@pytest.mark.parametrize("server", [HttpLimits(body_timeout_s=0.3)], indirect=True)
def test_a_body_that_arrives_in_time_is_read_whole(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhe")
        time.sleep(0.05)
        sock.sendall(b"llo")
        answer = b""
        while not answer.endswith(b"hello"):
            answer += sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200")
    assert server.stats.closed_body_timeout == 0


@pytest.mark.parametrize(
    "server", [HttpLimits(write_timeout_s=0.3, keepalive_timeout_s=60)], indirect=True
)
def test_a_response_its_client_stops_reading_is_cut(server: Server) -> None:
    with server.connect() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /flood HTTP/1.1\r\nHost: t\r\n\r\n")  # and never read
        wait_for(lambda: server.stats.closed_write_timeout == 1)
        wait_for(lambda: len(server.seen) == 1)
    assert isinstance(server.seen[0], ConnectionError)
    assert server.get().endswith(b"hello")


@pytest.mark.parametrize("field", ["header_timeout_s", "body_timeout_s", "write_timeout_s"])
def test_a_limit_that_is_not_positive_is_refused(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        HttpLimits(**{field: 0})
