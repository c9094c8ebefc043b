"""A client that stops reading a stream holds nothing: on every streaming API the stream is cut
once its bounded buffer fills, its generation is closed (the backend frees the sequence) long
before max_tokens, the cut is counted in a metric and noted in the request's log line, and the
server answers the next client.

The generation side is ``EndlessBackend``: the model's real tokenizer, and one token after
another as fast as the loop lets it (a model faster than any client, so only the client can
fall behind; the embedded model on these cores is too slow to outrun a socket's buffers).
The stuck reader is a raw socket with a small receive buffer that never reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer
from prometheus_client import CollectorRegistry

from mlxppd.http.anthropic_api import add_anthropic_routes
from mlxppd.http.api_state import DEFAULT_STREAM_STALL_S
from mlxppd.http.openai_api import create_app
from mlxppd.runtime.backends.contract import Health, SamplingParams, TokenEvent
from mlxppd.runtime.observability.metrics import PipelineMetrics
from tests.support.http import LoopThread, post, stream

MAX_TOKENS = 8000


class EndlessBackend:
    """Generates the same token until max_tokens, as fast as it is read; counts what is open."""

    model_id = "endless"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token = tokenizer.encode(" hello", add_special_tokens=False)[0]
        self.open = 0
        self.pulled: list[int] = []  # per finished generation: the tokens it gave

    def health(self) -> Health:
        return Health(True, "endless")

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        self.open += 1
        given = 0
        try:
            while given < params.max_tokens:
                await asyncio.sleep(0)
                given += 1
                yield TokenEvent(token=self.token)
        finally:
            self.open -= 1
            self.pulled.append(given)

    def generate_choices(
        self, request_id: str, prompt: list[int], params: Sequence[SamplingParams]
    ) -> list[AsyncIterator[TokenEvent]]:
        return [self.generate(request_id, prompt, p) for p in params]


class Server:
    def __init__(self, model_dir: Path, stall_s: float) -> None:
        self.backend = EndlessBackend(load_tokenizer(model_dir))
        self.metrics = PipelineMetrics(CollectorRegistry())
        app = create_app(
            self.backend, metrics=self.metrics, stream_buffer_events=8, stream_stall_s=stall_s
        )
        add_anthropic_routes(app)
        self.loop = LoopThread("stream-stalls")
        self.url = self.loop.serve(app)
        self.port = int(self.url.rsplit(":", 1)[1])

    def stalled(self) -> float:
        sample = self.metrics.registry.get_sample_value(
            "mlxpp_http_connections_cut_total", {"reason": "stream_stalled"}
        )
        return sample or 0.0


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path) -> Iterator[Server]:
    """A server that cuts a stream whose buffer stays full for half a second."""
    running = Server(embedded_model_dir, stall_s=0.5)
    yield running
    running.loop.stop()


@pytest.fixture(scope="module")
def patient(embedded_model_dir: Path) -> Iterator[Server]:
    """A server with the default stall window: its readers are slow, never stopped."""
    running = Server(embedded_model_dir, stall_s=DEFAULT_STREAM_STALL_S)
    yield running
    running.loop.stop()


STREAMS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"prompt": "hi"}),
    "messages": (
        "/v1/messages",
        {"model": "endless", "messages": [{"role": "user", "content": "x"}]},
    ),
}


def stuck_reader(
    port: int, path: str, body: dict[str, Any], max_tokens: int = MAX_TOKENS
) -> socket.socket:
    """A client that asks for a stream and never reads a byte of it (until it does)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    raw = json.dumps({**body, "max_tokens": max_tokens, "stream": True}).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    sock.sendall(head.encode() + raw)
    return sock


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_a_stream_whose_client_stops_reading_is_cut_and_its_generation_closed(
    server: Server, api: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlxppd.http")
    path, body = STREAMS[api]
    before, finished = server.stalled(), len(server.backend.pulled)
    with stuck_reader(server.port, path, body):
        wait_for(lambda: server.stalled() == before + 1, "the stuck stream was never cut")
        wait_for(lambda: len(server.backend.pulled) == finished + 1, "its generation stayed open")
    assert server.backend.open == 0
    assert server.backend.pulled[-1] < MAX_TOKENS / 4, "the generation ran on for the client"
    wait_for(
        lambda: any("client stopped reading" in r.getMessage() for r in caplog.records),
        "the request's log line does not say why it ended",
    )
    # The next client is answered, all of it.
    status, answer = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer


def test_a_client_that_reads_gets_every_event_in_order(patient: Server) -> None:
    body = {"prompt": "hi", "max_tokens": 200, "n": 2}
    status, events = stream(patient.url, "/v1/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    for index in (0, 1):
        texts = [e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert "".join(texts) == "hello" + " hello" * 199  # a first token loses its space


def test_a_reader_that_pauses_within_the_stall_window_gets_the_whole_stream(
    patient: Server,
) -> None:
    """The model outruns this client (its buffers fill at once); it pauses a second, well within
    the stall window, then reads on: it is slow, not gone, and loses nothing."""
    before = patient.stalled()
    sock = stuck_reader(patient.port, "/v1/completions", {"prompt": "hi"}, max_tokens=400)
    with sock:
        time.sleep(1.0)  # the pause; the cut would come DEFAULT_STREAM_STALL_S after it filled
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"data: [DONE]" in body, "the paused reader's stream was cut"
    assert patient.stalled() == before
