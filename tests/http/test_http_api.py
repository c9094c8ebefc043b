"""The OpenAI API over the real embedded model (InProcessBackend, 1 and 2 stages), real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxppd.runtime.backends.contract import BackendUnavailable, SamplingParams, TokenEvent
from tests.support.http import LiveServer, open_stream, post, request, sse_events, stream

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
#: enough KV for a short chat (about 50 tokens) but not for a long prompt
BUDGET_TOKENS = 100
#: the poem is cut by max_tokens (finish_reason "length") after this many tokens
POEM_TOKENS = 6


@pytest.fixture(scope="module")
def servers(embedded_model_dir: Path) -> Iterator[dict[int, LiveServer]]:
    started: dict[int, LiveServer] = {}
    try:
        for stages in (1, 2):
            started[stages] = LiveServer(embedded_model_dir, stages)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def urls(servers: dict[int, LiveServer]) -> dict[int, str]:
    return {stages: server.start_app() for stages, server in servers.items()}


@pytest.fixture(scope="module")
def reference(servers: dict[int, LiveServer], embedded_model_dir: Path) -> Any:
    """``reference(messages, max_tokens)``: single-process mlx-lm's own greedy text."""
    server = servers[1]
    from mlx_lm import generate

    from tests.support.references import load_reference

    model, tokenizer = server.on_mlx(lambda: load_reference(embedded_model_dir))
    cache: dict[tuple[str, int], str] = {}

    def run(messages: list[dict[str, str]], max_tokens: int) -> str:
        key = (json.dumps(messages), max_tokens)
        if key not in cache:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            cache[key] = server.on_mlx(
                lambda: generate(model, tokenizer, prompt, max_tokens=max_tokens)
            )
        return cache[key]

    return run


def chat(url: str, messages: list[dict[str, str]], **fields: Any) -> tuple[int, Any]:
    return post(url, CHAT, {"messages": messages, "temperature": 0, **fields})


@pytest.fixture(scope="module")
def answer(urls: dict[int, str]) -> Any:
    """``answer(stages, messages, max_tokens)``: the server's own greedy (status, body) for
    one request on its own, asked once per module (every test comparing with it shares it)."""
    cache: dict[tuple[int, str, int], tuple[int, Any]] = {}

    def run(stages: int, messages: list[dict[str, str]], max_tokens: int) -> tuple[int, Any]:
        key = (stages, json.dumps(messages), max_tokens)
        if key not in cache:
            cache[key] = chat(urls[stages], messages, max_tokens=max_tokens)
        return cache[key]

    return run


# --- parity and streaming, on 1 and 2 stages ---


@pytest.mark.parametrize("stages", [1, 2])
def test_greedy_chat_equals_mlx_lm(answer: Any, reference: Any, stages: int) -> None:
    status, body = answer(stages, FRANCE, 12)
    assert status == 200, body
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": reference(FRANCE, 12),
        "refusal": None,
    }
    assert body["choices"][0]["finish_reason"] == "stop"  # EOS before 12 tokens
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "smollm2-135m"
    assert isinstance(body["created"], int)

    status, body = answer(stages, POEM, POEM_TOKENS)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == reference(POEM, POEM_TOKENS)
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == POEM_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + POEM_TOKENS


@pytest.mark.parametrize("stages", [1, 2])
def test_stream_deltas_concatenate_to_the_full_text(
    urls: dict[int, str], answer: Any, stages: int
) -> None:
    fields = {"messages": POEM, "temperature": 0, "max_tokens": POEM_TOKENS}
    _, whole = answer(stages, POEM, POEM_TOKENS)  # the same request, not streamed
    status, events = stream(
        urls[stages], CHAT, {**fields, "stream_options": {"include_usage": True}}
    )
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


# --- stop strings, logprobs, finish reasons, usage ---


def test_stop_string_ends_generation_before_it(urls: dict[int, str]) -> None:
    status, body = chat(urls[1], FRANCE, max_tokens=12, stop=["Paris"])
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "The capital of France is "
    assert body["choices"][0]["finish_reason"] == "stop"


def test_stream_never_shows_part_of_a_stop_string(urls: dict[int, str]) -> None:
    # " is" comes a token before " Paris": it must be held back, then dropped with the stop.
    fields = {"messages": FRANCE, "temperature": 0, "max_tokens": 12, "stop": "is Paris"}
    status, events = stream(urls[1], CHAT, fields)
    assert status == 200
    deltas = [c["choices"][0]["delta"].get("content", "") for c in events[:-1]]
    assert "".join(deltas) == "The capital of France "
    assert not any("is" in d for d in deltas)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_completions_stop_string_and_stream(urls: dict[int, str]) -> None:
    fields = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    _, plain = post(urls[1], COMPLETIONS, fields)
    text = plain["choices"][0]["text"]
    assert text.startswith("Paris") and "." in text  # the stop below has a "." to end at
    _, stopped = post(urls[1], COMPLETIONS, {**fields, "stop": ["."]})
    assert stopped["choices"][0]["text"] == text.split(".")[0]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    status, events = stream(urls[1], COMPLETIONS, {**fields, "stop": ["."]})
    assert status == 200 and events[-1] == "[DONE]"
    assert all(c["object"] == "text_completion" for c in events[:-1])
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == text.split(".")[0]


def test_chat_logprobs(urls: dict[int, str]) -> None:
    status, body = chat(urls[1], FRANCE, max_tokens=12, logprobs=True, top_logprobs=0)
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    # EOS ends the answer and counts as a completion token, but has no text of its own
    assert len(content) == body["usage"]["completion_tokens"] - 1
    assert "".join(e["token"] for e in content) == "The capital of France is Paris."
    for entry in content:
        assert entry["logprob"] <= 0
        assert bytes(entry["bytes"]).decode() == entry["token"]
        assert entry["top_logprobs"] == []
    # Streamed, each chunk carries its tokens' logprobs (the first 4 tokens show it).
    status, events = stream(
        urls[1], CHAT, {"messages": FRANCE, "temperature": 0, "max_tokens": 4, "logprobs": True}
    )
    streamed = [
        e
        for c in events[:-1]
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert [e["token"] for e in streamed] == [e["token"] for e in content][:4]
    assert [e["logprob"] for e in streamed] == pytest.approx(
        [e["logprob"] for e in content][:4], abs=1e-4
    )


def test_completions_logprobs_length_and_usage(
    urls: dict[int, str], servers: dict[int, LiveServer]
) -> None:
    prompt = "The capital of France is"
    n = 4
    status, body = post(
        urls[2], COMPLETIONS, {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0}
    )
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == n
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert len(logprobs["top_logprobs"]) == n
    prompt_tokens = len(servers[2].backend.tokenizer.encode(prompt))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "total_tokens": prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": 0},  # the in-process backend keeps none
    }
    # A prompt given as token ids is the same prompt.
    ids = servers[2].backend.tokenizer.encode(prompt)
    _, again = post(urls[2], COMPLETIONS, {"prompt": [ids], "max_tokens": n, "temperature": 0})
    assert again["choices"][0]["text"] == choice["text"]


def test_concurrent_requests_each_equal_their_own_single_result(
    urls: dict[int, str], answer: Any
) -> None:
    # Two prompts of different lengths batched together, one ending at EOS and one cut by
    # max_tokens; their single results are the parity test's (the same requests on their own).
    asked = [(FRANCE, 12), (POEM, POEM_TOKENS)]
    single = [answer(2, p, n)[1]["choices"][0]["message"]["content"] for p, n in asked]
    results: list[str | None] = [None] * len(asked)

    def one(i: int) -> None:
        prompt, n = asked[i]
        results[i] = chat(urls[2], prompt, max_tokens=n)[1]["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asked))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == single


# --- errors ---


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (CHAT, {"messages": FRANCE, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": FRANCE, "max_tokens": "8"}, "max_tokens"),
        (CHAT, {"messages": FRANCE, "max_completion_tokens": -1}, "max_completion_tokens"),
        (CHAT, {"messages": FRANCE, "temperature": -0.1}, "temperature"),
        (CHAT, {"messages": FRANCE, "temperature": 2.5}, "temperature"),
        (CHAT, {"messages": FRANCE, "top_p": 0}, "top_p"),
        (CHAT, {"messages": FRANCE, "top_p": 1.5}, "top_p"),
        (CHAT, {"messages": FRANCE, "n": 17}, "n"),
        (CHAT, {"messages": FRANCE, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (CHAT, {"messages": FRANCE, "stop": 3}, "stop"),
        (CHAT, {"messages": FRANCE, "seed": 1.5}, "seed"),
        (CHAT, {"messages": FRANCE, "logprobs": 1}, "logprobs"),
        (CHAT, {"messages": FRANCE, "stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETIONS, {}, "prompt"),
        (COMPLETIONS, {"prompt": 7}, "prompt"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 9}, "logprobs"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
    ],
)
def test_validation_errors_name_the_field(
    urls: dict[int, str], path: str, body: dict[str, Any], param: str
) -> None:
    status, answer = post(urls[1], path, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_bad_json_big_body_unknown_model_and_long_prompt(servers: dict[int, LiveServer]) -> None:
    url = servers[1].start_app(max_context_tokens=64, max_body_bytes=10_000)
    status, _, body = request(url, "POST", CHAT, raw=b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, _, body = request(url, "POST", CHAT, raw=b"[1, 2]")
    assert status == 400
    status, _, body = request(url, "POST", CHAT, raw=b"x" * 20_000)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body = post(url, CHAT, {"model": "gpt-4", "messages": FRANCE})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = post(url, CHAT, {"messages": [{"role": "user", "content": "word " * 200}]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body = post(url, CHAT, {"messages": FRANCE, "max_tokens": 60})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, _, body = request(url, "GET", "/v1/nowhere")
    assert status == 404 and "error" in body


def test_kv_admission_rejection_is_a_400_when_it_can_never_fit_and_a_503_when_it_can_later(
    servers: dict[int, LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The 2-stage server's stages with a small KV budget for this test: the budget
    # ``LiveServer(..., kv_budget_bytes=...)`` gives each stage's KV manager, set on the running
    # server instead of loading the model again (restored when the test ends).
    small = servers[2]
    per_token = max(m.bytes_per_token for m in small.backend.kv)
    assert kv_used(small) == [0, 0]
    for manager in small.backend.kv:
        monkeypatch.setattr(manager, "budget_bytes", per_token * BUDGET_TOKENS)
    url = small.start_app()
    long = [{"role": "user", "content": "Tell me about the sea. " * 30}]
    for sender in (post, stream):
        status, answer = sender(url, CHAT, {"messages": long, "max_tokens": 8})
        if sender is stream:
            answer = answer[0]
        # More than the whole budget: retrying cannot help, so no Retry-After and a 400.
        assert status == 400, answer
        error = answer["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["stage"] == 0
        assert error["reason"] == "memory"
        assert error["budget_bytes"] == per_token * BUDGET_TOKENS
        assert error["used_bytes"] == 0
        assert error["active_sequences"] == 0
        assert error["required_bytes"] > error["budget_bytes"]
    status, headers, _ = request(url, "POST", CHAT, {"messages": long, "max_tokens": 8})
    assert status == 400 and "Retry-After" not in headers
    # A request that fits an empty budget but not beside one holding most of it: a 503.
    holder, response = open_stream(url, CHAT, {"messages": FRANCE, "max_tokens": 40})
    try:
        assert response.status == 200
        status, headers, body = request(url, "POST", CHAT, {"messages": FRANCE, "max_tokens": 40})
        assert status == 503, body
        assert body["error"]["code"] == "kv_admission_rejected"
        assert body["error"]["required_bytes"] <= body["error"]["budget_bytes"]
        assert headers["Retry-After"] == "1"
    finally:
        holder.close()
    # The server notices the closed stream and frees its KV; then the next one is served.
    deadline = time.monotonic() + 60
    while (answer := chat(url, FRANCE, max_tokens=5))[0] == 503:
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)
    status, body = answer
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].startswith("The capital of France")
    assert kv_used(small) == [0, 0]


def kv_used(server: LiveServer) -> list[int]:
    async def read() -> list[int]:
        return [m.used_bytes for m in server.backend.kv]

    return server.call(read())


def test_client_disconnect_releases_kv_on_every_stage(
    servers: dict[int, LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = servers[2]
    # How the backend's generation ended: closed by the server with tokens still to come
    # (the disconnect), or run to its end (max_tokens, or the server stopping at EOS).
    yielded: list[int] = []
    endings: list[str] = []
    generate = server.backend.generate

    async def watched(
        request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        ending = "exhausted"
        try:
            async with contextlib.aclosing(generate(request_id, prompt, params)) as events:
                async for event in events:
                    yielded.append(event.token)
                    yield event
        except (GeneratorExit, asyncio.CancelledError):
            ending = "closed"
            raise
        finally:
            endings.append(ending)

    monkeypatch.setattr(server.backend, "generate", watched)
    url = server.start_app()
    body = {"messages": POEM, "temperature": 0, "max_tokens": 200}
    conn, response = open_stream(url, CHAT, body)
    events = sse_events(response)
    for _ in range(3):
        next(events)
    used = kv_used(server)
    assert len(used) == 2 and all(u > 0 for u in used)
    response.close()
    conn.close()
    # Generous: only KV that is never released runs into the deadline.
    deadline = time.monotonic() + 120
    while kv_used(server) != [0, 0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_used(server) == [0, 0]
    # Released because the client left, not because the generation ended anyway.
    assert endings == ["closed"]
    assert len(yielded) < 200
    assert yielded[-1] not in set(server.backend.tokenizer.eos_token_ids)


class FailingBackend:
    """The real backend, with the pipeline breaking after two tokens (fault injection)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.model_id = inner.model_id
        self.tokenizer = inner.tokenizer

    def health(self) -> Any:
        return self.inner.health()

    def generate_choices(
        self, request_id: str, prompt: list[int], params: Any
    ) -> list[AsyncIterator[TokenEvent]]:
        return [self.generate(request_id, prompt, p) for p in params]

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        events = self.inner.generate(request_id, prompt, params)
        try:
            for _ in range(2):
                yield await events.__anext__()
            raise BackendUnavailable("stage 1 disconnected")
        finally:
            await events.aclose()


def test_error_mid_stream_is_the_last_event(servers: dict[int, LiveServer]) -> None:
    from aiohttp import web

    from mlxppd.http.openai_api import create_app

    server = servers[1]

    async def start() -> tuple[str, Any]:
        runner = web.AppRunner(create_app(FailingBackend(server.backend)))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}", runner

    url, runner = server.call(start())
    try:
        status, events = stream(url, CHAT, {"messages": POEM, "max_tokens": 8})
        assert status == 200
        assert events[-1]["error"]["code"] == "backend_unavailable"
        assert "[DONE]" not in events
        status, body = post(url, CHAT, {"messages": POEM, "max_tokens": 8})
        assert status == 503 and body["error"]["code"] == "backend_unavailable"
    finally:
        server.call(runner.cleanup())
    assert kv_used(server) == [0]


# --- auth, models, health ---


def test_api_key(servers: dict[int, LiveServer]) -> None:
    url = servers[1].start_app(api_key="s3cret")
    status, _, body = request(url, "GET", "/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, _ = request(url, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, body = post(url, CHAT, {"messages": FRANCE}, headers={"Authorization": "Basic s3cret"})
    assert status == 401
    status, _, body = request(url, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert status == 200 and body["data"][0]["id"] == "smollm2-135m"
    status, _, body = request(url, "GET", "/health")
    assert status == 200


def test_models_health_and_alias(servers: dict[int, LiveServer]) -> None:
    url = servers[2].start_app(alias="my-model")
    status, _, body = request(url, "GET", "/v1/models")
    assert status == 200
    assert body["object"] == "list"
    assert body["data"] == [
        {
            "id": "my-model",
            "object": "model",
            "created": body["data"][0]["created"],
            "owned_by": "mlxpp",
        }
    ]
    status, headers, body = request(url, "GET", "/health")
    assert status == 200 and body["status"] == "ok"
    assert [s["stage"] for s in body["stages"]] == [0, 1]
    assert headers["X-Request-Id"].startswith("req-")
    status, body = chat(url, FRANCE, model="my-model", max_tokens=3)
    assert status == 200 and body["model"] == "my-model"
