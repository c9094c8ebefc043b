"""A live two-stage cluster (with an api key) against hostile HTTP clients.

Every attack is answered with a 4xx or shrugged off, and afterwards the same benign request
returns the same greedy text and /health is 200: no attack closes a stage link or stalls the
coordinator. How long the event loop stalls under each attack is measured by
``bench/attacks.py`` (timing goals live in bench/, not in tests). The attacks only a server
without an api key is open to (a web page's cross-origin request, DNS rebinding) go to one
served in-process without a key, and are followed by a local client's request there.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxppd.http.requests import ChatCompletionRequest, ChatMessage, CompletionRequest
from mlxppd.wire.handshake import HandshakeType, pack_envelope, prologue
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.noise import NoiseHandshake
from tests.adversarial.bad_requests import one_bad_field, one_bad_message
from tests.support.clusters import RunningCluster, stage_port_and_pid, start_cluster, wait_gone
from tests.support.metrics import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "adversarial-suite-key-7f3a9c"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: the request every test ends with (4 greedy tokens: enough to see the same text come back)
BENIGN = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
MESSAGE = {"role": "user", "content": "What is the capital of France?"}
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path, model_cache: Path
) -> Iterator[RunningCluster]:
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    tmp = tmp_path_factory.mktemp("attacked")
    running = start_cluster(
        tmp, env, "--pp-size", "2", "--api-key", KEY, "--metrics", "--metrics-port", "0",
        "--metrics-ready-file", str(tmp / "metrics.ready"),
    )  # fmt: skip
    yield running
    assert running.stop() == 0, running.log()
    assert wait_gone(running.stage_pids) == [], "stage processes left behind"


@pytest.fixture(scope="module")
def metrics_url(cluster: RunningCluster) -> str:
    """The --metrics-port listener's base URL, from its ready file."""
    ready = cluster.log_path.parent / "metrics.ready"
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline, "the metrics listener never started"
        time.sleep(0.1)
    return ready.read_text().strip()


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.url, headers=AUTH, timeout=120) as http:
        yield http


def benign(client: httpx.Client) -> str:
    response = client.post("/v1/completions", json=BENIGN)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def before(client: httpx.Client) -> str:
    """The benign request's greedy text before any attack."""
    return benign(client)


@pytest.fixture(autouse=True)
def still_serving(client: httpx.Client, cluster: RunningCluster, before: str) -> Iterator[None]:
    yield
    assert benign(client) == before, "the attack changed what the cluster answers"
    assert httpx.get(f"{cluster.url}/health", timeout=30).status_code == 200
    assert "Traceback" not in cluster.log(), cluster.log()[-4000:]


def refused(response: httpx.Response) -> dict[str, Any]:
    """A 4xx with an OpenAI-shaped error body; the error object."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert error["message"]
    return dict(error)


# -- every malformed or out-of-range field, from the request models themselves -------------------

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
COMPLETIONS = one_bad_field(CompletionRequest, BENIGN)
CHATS = st.one_of(
    one_bad_field(ChatCompletionRequest, {"messages": [MESSAGE], "max_tokens": 8}),
    one_bad_message(ChatMessage, {"max_tokens": 8, "temperature": 0}, MESSAGE),
)


def _post_raw(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps, not httpx's encoder: NaN and huge integers go out as a careless client sends them.
    raw = json.dumps(body).encode()
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


@FUZZ
@given(body=COMPLETIONS)
def test_every_bad_completions_field_is_a_4xx(client: httpx.Client, body: dict[str, Any]) -> None:
    refused(_post_raw(client, "/v1/completions", body))


@FUZZ
@given(body=CHATS)
def test_every_bad_chat_field_is_a_4xx(client: httpx.Client, body: dict[str, Any]) -> None:
    refused(_post_raw(client, "/v1/chat/completions", body))


def test_the_seed_that_took_the_pipeline_down_is_a_400(client: httpx.Client) -> None:
    """``seed: -1`` with a temperature once reached the last stage and closed its link."""
    body = {"prompt": "hi", "seed": -1, "temperature": 0.7, "max_tokens": 4}
    assert refused(client.post("/v1/completions", json=body))["param"] == "seed"
    body = {**body, "seed": 2**64 - 1}  # the largest seed is served
    assert client.post("/v1/completions", json=body).status_code == 200


def test_a_prompt_or_max_tokens_past_the_context_is_a_400(client: httpx.Client) -> None:
    error = refused(client.post("/v1/completions", json={**BENIGN, "max_tokens": 2**24}))
    assert error["code"] == "context_length_exceeded"
    error = refused(client.post("/v1/completions", json={**BENIGN, "prompt": "word " * 20000}))
    assert error["code"] == "context_length_exceeded"


# -- bodies built to cost the server time or memory ----------------------------------------------


class Probe:
    """Asks /health over and over on its own connections while an attack runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.answers.append(httpx.get(f"{self.url}/health", timeout=60).status_code)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        assert self.answers and set(self.answers) == {200}, self.answers


def test_huge_stop_strings_tiny_messages_deep_nesting_and_bad_header_bytes_are_4xx(
    client: httpx.Client, cluster: RunningCluster
) -> None:
    with Probe(cluster.url):
        stops = ["x" * MIB] * 4
        refused(client.post("/v1/completions", json={**BENIGN, "stop": stops}))
        just_under = ["x" * (MIB // 2)]
        assert (
            refused(client.post("/v1/completions", json={**BENIGN, "stop": just_under}))["param"]
            == "stop"
        )
        tiny = b'{"role":"user","content":"a"},'
        count = (4 * MIB - 64) // len(tiny)
        body = b'{"messages":[' + tiny * (count - 1) + tiny[:-1] + b'],"max_tokens":4}'
        error = refused(client.post("/v1/chat/completions", content=body))
        assert error["param"] == "messages"
        deep = b'{"prompt":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
        assert refused(client.post("/v1/completions", content=deep))["code"] == "invalid_json"
    status, answer = raw_request(
        cluster.url,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xfd\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    assert status == 400, answer
    assert b"invalid_header" in answer


def raw_request(url: str, data: bytes) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer


def test_slowloris_does_not_starve_a_normal_client(cluster: RunningCluster) -> None:
    """200 connections each sending one header byte a second; a normal client gets answered
    (a 5 s timeout stands for "not starved"), and the server cuts the dawdlers off."""
    host, port = cluster.url.removeprefix("http://").rsplit(":", 1)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200
    slow = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
    try:
        cut = 0
        for i in range(len(head)):
            for sock in list(slow):
                try:
                    sock.sendall(head[i : i + 1])
                except OSError:
                    slow.remove(sock)
                    sock.close()
                    cut += 1
            assert httpx.get(f"{cluster.url}/health", timeout=5).status_code == 200
            if not slow:
                break
            time.sleep(1.0)
        assert not slow, "the server kept connections whose head never ended"
        assert cut == 200
    finally:
        for sock in slow:
            sock.close()


# -- what an unauthenticated caller learns, and what reaches the log ---------------------------


def test_without_the_key_health_says_one_word_and_metrics_are_closed(
    cluster: RunningCluster, client: httpx.Client, metrics_url: str
) -> None:
    public = httpx.get(f"{cluster.url}/health", timeout=30)
    assert public.status_code == 200 and public.json() == {"status": "ok"}
    detailed = client.get("/health").json()
    assert detailed["status"] == "ok" and len(detailed["stages"]) == 2
    assert httpx.get(f"{cluster.url}/metrics", timeout=30).status_code == 401
    assert client.get("/metrics").status_code == 200
    # The --metrics-port listener is the scraper's: no key there.
    scraper = httpx.get(f"{metrics_url}/metrics", timeout=30)
    assert scraper.status_code == 200 and "mlxpp_" in scraper.text


def test_a_forged_newline_in_the_path_is_logged_escaped(
    cluster: RunningCluster, client: httpx.Client
) -> None:
    assert client.get("/v1/models%0AFORGED-LOG-LINE").status_code == 404
    deadline = time.monotonic() + 60
    while "FORGED-LOG-LINE" not in cluster.log():
        assert time.monotonic() < deadline, "the request was never logged"
        time.sleep(0.1)
    log = cluster.log()
    assert "/v1/models\\nFORGED-LOG-LINE" in log
    assert not any(line.startswith("FORGED-LOG-LINE") for line in log.splitlines())


def test_a_forged_newline_in_a_handshakes_cluster_name_is_logged_escaped(
    cluster: RunningCluster,
) -> None:
    """A client hello whose cluster name carries a newline: refused as bad_hello, and the
    stage's log line shows the name escaped. The payload is built by hand (the encoder refuses
    such a name), inside a genuine Noise message 1, which anyone can make: its key is public."""
    port, _ = stage_port_and_pid(cluster, 0)
    name, node = b"evil\nFORGED-HELLO-LINE", b"stage-9"
    payload = b"\x00\x00" + bytes([len(name)]) + name + bytes([len(node)]) + node
    noise = NoiseHandshake(
        initiator=True, static=NodeKey.generate(), psk=os.urandom(32), prologue=prologue()
    )
    body = noise.write_message_1(payload)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(pack_envelope(HandshakeType.CLIENT_HELLO, body))
        sock.settimeout(30)
        while sock.recv(4096):  # the stage closes the connection
            pass
    deadline = time.monotonic() + 60
    while "FORGED-HELLO-LINE" not in cluster.log():
        assert time.monotonic() < deadline, "the refused hello was never logged"
        time.sleep(0.1)
    log = cluster.log()
    assert "evil\\nFORGED-HELLO-LINE" in log
    assert not any(line.startswith("FORGED-HELLO-LINE") for line in log.splitlines())


# -- holding connections and streams, costing the tokenizer, breaking the schema bound ---------


def _answer_or_close(sock: socket.socket) -> bytes:
    """What the server sends before it closes the connection (a reset counts as closed)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_slow_admin_bodies_do_not_fill_the_connection_cap(cluster: RunningCluster) -> None:
    """1,100 unsigned admin requests, each announcing a 60 KB body and sending one byte of it:
    they held every one of the listener's 1,024 connections (so /health answered 503) for as
    long as they stayed, and their release logged 1,024 tracebacks. Now each is refused on its
    header, before its body, and closed; none is left holding a connection."""
    host, port = cluster.url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /admin/v1/drain HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 60000\r\n\r\n{"
    ).encode()
    slow = []
    try:
        for _ in range(1100):
            sock = socket.create_connection((host, int(port)), timeout=60)
            sock.sendall(head)
            slow.append(sock)
        answers = [_answer_or_close(sock) for sock in slow]
    finally:
        for sock in slow:
            sock.close()
    statuses = {a.split(b" ", 2)[1] for a in answers}
    assert statuses <= {b"401", b"503"}, statuses
    assert sum(a.startswith(b"HTTP/1.1 401") for a in answers) >= 1024
    assert all(b'"missing"' in a for a in answers if a.startswith(b"HTTP/1.1 401"))


def test_a_stream_whose_reader_stops_is_cut_and_the_others_are_served(
    cluster: RunningCluster, client: httpx.Client
) -> None:
    """A client that asks for a stream and never reads it: the coordinator's generation does
    not wait on it (no micro-batch group does), is cut once its small buffer fills, and frees
    its sequence; streams started meanwhile get every token."""
    host, port = cluster.url.removeprefix("http://").rsplit(":", 1)

    def cuts() -> float:
        # Whichever notices first: the stream's full buffer, or on a slow host the listener's
        # write deadline (the socket's buffer full for write_timeout_s).
        return sum(
            metric(client, f'mlxpp_http_connections_cut_total{{reason="{reason}"}}')
            for reason in ("stream_stalled", "write_timeout")
        )

    cut_before = cuts()
    # top_logprobs makes each chunk about 2 KB: the socket's buffers fill within tens of tokens.
    body = json.dumps({
        "messages": [{"role": "user", "content": "Count from 1 to 1000."}], "stream": True,
        "max_tokens": 4000, "temperature": 0, "logprobs": True, "top_logprobs": 20,
    }).encode()  # fmt: skip
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect((host, int(port)))
    try:
        stuck.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        others: list[int] = []

        def other() -> None:
            streamed = {
                **BENIGN,
                "max_tokens": 24,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with client.stream("POST", "/v1/completions", json=streamed) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: {")]
            others.append(json.loads(lines[-1][6:])["usage"]["completion_tokens"])

        threads = [threading.Thread(target=other) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert others == [24, 24], "a stream started beside the stuck one was starved"
        deadline = time.monotonic() + 300
        while cuts() <= cut_before:
            assert time.monotonic() < deadline, "the stuck stream was never cut"
            time.sleep(0.5)
        while metric(client, "mlxpp_active_sequences") > 0:
            assert time.monotonic() < deadline, "the cut stream's sequence was never freed"
            time.sleep(0.5)
    finally:
        stuck.close()


def test_a_huge_tool_list_is_refused_before_it_is_tokenized(
    client: httpx.Client, cluster: RunningCluster
) -> None:
    """3.7 MiB of tool definitions: tokenized in full (1.4 M tokens, 12 s of the one tokenizer
    thread every request shares) before the context check; now refused by their length."""
    schema = {
        "type": "object",
        "properties": {"p": {"type": "string", "description": "w" * 29_000}},
    }
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": schema}}
        for i in range(128)
    ]
    body = {"messages": [MESSAGE], "tools": tools, "max_tokens": 4}
    with Probe(cluster.url):
        error = refused(client.post("/v1/chat/completions", json=body))
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]


def test_a_schema_past_the_bound_as_the_stage_takes_it_is_a_400_not_a_500(
    client: httpx.Client,
) -> None:
    """Under 64 KiB as compact UTF-8, three times that as the escaped JSON the stage compiles."""
    schema = {"type": "object", "description": "é" * 25_000}
    body = {
        "messages": [MESSAGE], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }  # fmt: skip
    error = refused(client.post("/v1/chat/completions", json=body))
    assert "65536" in error["message"] and error["param"].startswith("response_format")


@pytest.fixture(scope="module")
def keyless(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path, model_cache: Path
) -> Iterator[RunningCluster]:
    """The same model served in one process, without an api key."""
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    running = start_cluster(tmp_path_factory.mktemp("keyless"), env)
    yield running
    assert running.stop() == 0, running.log()


def test_without_a_key_a_web_page_elsewhere_cannot_drive_the_api(keyless: RunningCluster) -> None:
    """A page the operator visits may POST text/plain to any origin without a preflight, and a
    DNS-rebinding page reaches loopback under its own name: both are refused; the operator's
    own client is served."""
    url, host = keyless.url, keyless.url.removeprefix("http://")
    page = {"Content-Type": "text/plain", "Origin": "http://evil.example"}
    answer = httpx.post(f"{url}/v1/completions", content=json.dumps(BENIGN), headers=page)
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "origin_not_allowed"
    plain = httpx.post(f"{url}/v1/completions", content=json.dumps(BENIGN),
                       headers={"Content-Type": "text/plain"})  # fmt: skip
    assert plain.status_code == 415
    rebound = httpx.get(f"{url}/v1/models", headers={"Host": "rebound.example:80"})
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
    served = httpx.post(f"{url}/v1/completions", json=BENIGN, headers={"Origin": url}, timeout=120)
    assert served.status_code == 200, served.text
    assert httpx.get(f"http://{host}/health").status_code == 200
    assert "Traceback" not in keyless.log()
