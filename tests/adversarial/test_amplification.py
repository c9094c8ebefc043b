"""A few requests cannot occupy the pipeline, and malformed ones cannot flood the log.

A live two-stage cluster with an api key, ``--parallel 9`` (sequences at once, 8 for any one
client) and the default ``--max-choices-per-request`` (4). Every choice of ``n`` is a sequence:
two requests of four choices are all one client may hold, and its third is refused with a 503
(over its share); the room kept goes to a second client at once; with the pipeline full a third
client's request waits and is served as soon as room frees, before the first client's next one.
The bystander's latency under the attack is measured by ``bench/attacks.py``, not asserted
here. Requests aiohttp refuses itself (a duplicate ``Host``) are counted and summarized, never
one traceback each.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.clusters import RunningCluster, start_cluster, wait_gone
from tests.support.metrics import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "amplification-suite-key-41"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: sequences at once; one client may hold 8 of them (an eighth is kept for the next)
PARALLEL = 9
#: the bystander's request: four greedy tokens
BYSTANDER = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path, model_cache: Path
) -> Iterator[RunningCluster]:
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    tmp = tmp_path_factory.mktemp("amplified")
    running = start_cluster(
        tmp, env, "--pp-size", "2", "--api-key", KEY, "--metrics", "--parallel", str(PARALLEL)
    )
    yield running
    assert running.stop() == 0, running.log()
    assert wait_gone(running.stage_pids) == [], "stage processes left behind"


@pytest.fixture(scope="module")
def eos_bias(embedded_model_dir: Path) -> dict[str, float]:
    """A logit_bias that bans every end-of-sequence token: an attack stream never ends itself."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = embedded_model_dir / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    assert ids, "the embedded model names no EOS token"
    return {str(i): -100.0 for i in ids}


def client_at(cluster: RunningCluster, address: str) -> httpx.Client:
    """A client whose connections come from ``address`` (a loopback address of its own: the
    server tells clients apart by address)."""
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=cluster.url, headers=AUTH, timeout=120, transport=transport)


@pytest.fixture(scope="module")
def attacker(cluster: RunningCluster) -> Iterator[httpx.Client]:
    with client_at(cluster, "127.0.0.1") as client:
        yield client


@pytest.fixture(scope="module")
def bystander(cluster: RunningCluster) -> Iterator[httpx.Client]:
    with client_at(cluster, "127.0.0.2") as client:
        yield client


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.05)


class AttackStream:
    """A streaming chat request of ``n`` sampled choices, each with 20 top logprobs, that runs
    until its client closes it; read in a thread of its own (a reader that stops is cut)."""

    def __init__(self, client: httpx.Client, eos_bias: dict[str, float], n: int = 4) -> None:
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story."}], "n": n,
            "max_tokens": 4000, "temperature": 1.0, "seed": 7, "logprobs": True,
            "top_logprobs": 20, "logit_bias": eos_bias, "stream": True,
        }  # fmt: skip
        self._context = client.stream("POST", "/v1/chat/completions", json=body)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self.events = 0

    def _read(self) -> None:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            for line in self._response.iter_lines():
                if line.startswith("data: {"):
                    self.events += 1
                    self._started.set()

    def __enter__(self) -> AttackStream:
        self._response = self._context.__enter__()
        assert self._response.status_code == 200, self._response.read()
        self._thread.start()
        assert self._started.wait(120), "the stream sent no event"
        return self

    def close(self) -> None:
        self._response.close()
        self._thread.join(30)

    def __exit__(self, *exc: object) -> None:
        self.close()
        with contextlib.suppress(httpx.HTTPError, OSError):
            self._context.__exit__(None, None, None)


def test_more_choices_than_the_operator_allows_is_a_400_naming_the_flag(
    attacker: httpx.Client,
) -> None:
    response = attacker.post("/v1/completions", json={**BYSTANDER, "n": 5})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and error["code"] == "too_many_choices"
    assert "--max-choices-per-request" in error["message"]


def test_choices_count_as_sequences_and_no_client_holds_the_pipeline(
    cluster: RunningCluster,
    attacker: httpx.Client,
    bystander: httpx.Client,
    eos_bias: dict[str, float],
) -> None:
    reference = bystander.post("/v1/completions", json=BYSTANDER)
    assert reference.status_code == 200, reference.text
    over_share = 'mlxpp_http_sequences_refused_total{reason="over_share"}'
    refused_before = metric(attacker, over_share)
    with (
        AttackStream(attacker, eos_bias) as first,
        AttackStream(attacker, eos_bias),
        client_at(cluster, "127.0.0.3") as third_client,
    ):
        # Two requests, eight sequences: all one client may hold of nine.
        assert metric(attacker, "mlxpp_http_sequences_in_flight") == 2 * 4
        more = attacker.post("/v1/completions", json=BYSTANDER)
        assert more.status_code == 503, more.text
        assert more.json()["error"]["code"] == "over_share"
        assert "Retry-After" in more.headers
        assert metric(attacker, over_share) == refused_before + 1
        # The ninth sequence was kept for the next client: a third one gets it at once.
        with AttackStream(third_client, eos_bias, n=1):
            assert metric(attacker, "mlxpp_http_sequences_in_flight") == PARALLEL

            # The pipeline is full: another client's request, within its share, waits for
            # room rather than failing...
            answer: dict[str, httpx.Response] = {}
            waiting = threading.Thread(
                target=lambda: answer.setdefault(
                    "r", bystander.post("/v1/completions", json=BYSTANDER)
                )
            )
            waiting.start()
            wait_for(lambda: metric(attacker, "mlxpp_http_sequences_waiting") == 1, "it wait")
            # ...and the client holding the most cannot take the room back while it waits.
            again = attacker.post("/v1/completions", json=BYSTANDER)
            assert again.status_code == 503, again.text
            first.close()  # the first attack's client leaves: its four sequences end
            waiting.join(120)
            assert answer["r"].status_code == 200, answer["r"].text
            got = answer["r"].json()["choices"][0]["text"]
            assert got == reference.json()["choices"][0]["text"]
            assert metric(attacker, "mlxpp_http_sequences_waiting") == 0
    wait_for(lambda: metric(attacker, "mlxpp_http_sequences_in_flight") == 0, "every release")


def test_duplicate_host_requests_are_counted_and_summarized_not_logged_each(
    cluster: RunningCluster, attacker: httpx.Client
) -> None:
    rejected = 'mlxpp_http_rejected_total{reason="malformed_request"}'
    before = metric(attacker, rejected)
    log_before = cluster.log_path.stat().st_size
    host, port = cluster.url.removeprefix("http://").rsplit(":", 1)
    request = (
        b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n"
        + f"Authorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode()
    )
    sent = 0
    for _ in range(2000):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(request)
            sent += len(request)
            assert sock.recv(64).split(b" ", 2)[1] == b"400"
    wait_for(lambda: metric(attacker, rejected) == before + 2000, "the 2,000 counted")
    grown = cluster.log_path.stat().st_size - log_before
    assert grown < sent, f"the log grew by {grown} bytes for {sent} sent"
    new = cluster.log().encode()[log_before:].decode(errors="replace")
    assert "Traceback" not in new
    assert "Duplicate 'Host' header found." in new  # summarized, with its detail


def test_dropped_admin_connections_leave_no_traceback(
    cluster: RunningCluster, attacker: httpx.Client
) -> None:
    log_before = cluster.log_path.stat().st_size
    host, port = cluster.url.removeprefix("http://").rsplit(":", 1)
    for path in ("/admin/v1/status", "/admin/v1/drain", "/admin/v1/repartition/events"):
        for _ in range(100):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100000\r\n\r\n{{".encode()
            )
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
            sock.close()  # a reset, mid-body
    assert attacker.get("/v1/models").status_code == 200
    new = cluster.log().encode()[log_before:].decode(errors="replace")
    assert "Traceback" not in new
    assert len(new.splitlines()) <= 300 + 5  # at most one line per connection
