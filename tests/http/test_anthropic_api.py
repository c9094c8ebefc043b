"""The Anthropic Messages API, spoken by the official ``anthropic`` client (embedded model, one
in-process stage: the API's translation is the point here, not the pipeline; api key): a message
says what the chat completion of the same conversation says."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings

from mlxppd.http.anthropic_api import add_anthropic_routes
from mlxppd.http.anthropic_models import MessageParam, MessagesRequest
from mlxppd.http.openai_api import create_app
from tests.adversarial.bad_requests import one_bad_field, one_bad_message
from tests.support.http import LiveServer, request

pytestmark = pytest.mark.slow

KEY = "test-key"
MODEL = "smollm"
SYSTEM = "You are a geography teacher. Answer in one full sentence."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 32
EVENT_ORDER = ["message_start", "content_block_start", "ping"]
EVENT_END = ["content_block_stop", "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def live(embedded_model_dir: Path) -> Iterator[LiveServer]:
    server = LiveServer(embedded_model_dir, 1)
    try:
        yield server
    finally:
        server.stop()


def serve(live: LiveServer, **options: Any) -> str:
    """An app from ``create_app`` with the Anthropic routes added, served; its base URL."""
    app = create_app(live.backend, alias=MODEL, **options)
    add_anthropic_routes(app)
    return live.serve(app)


@pytest.fixture(scope="module")
def base_url(live: LiveServer) -> str:
    return serve(live, api_key=KEY)


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(base_url: str) -> Any:
    """The OpenAI chat completion of SYSTEM + QUESTION at temperature 0."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    system = [{"role": "system", "content": SYSTEM}]
    return client.chat.completions.create(
        model=MODEL, messages=system + QUESTION, max_tokens=MAX_TOKENS, temperature=0
    )


@pytest.fixture(scope="module")
def message(claude: anthropic.Anthropic) -> Any:
    """``ask(claude)``: the plain message, asked once for the tests that compare with it."""
    return ask(claude)


def ask(claude: anthropic.Anthropic, extra: dict[str, Any] | None = None, **options: Any) -> Any:
    """SYSTEM + QUESTION at temperature 0, with ``options``; ``extra`` goes into the body as it
    is (this SDK no longer has parameters for temperature, top_p and top_k)."""
    body = {"model": MODEL, "system": SYSTEM, "messages": QUESTION, "max_tokens": MAX_TOKENS}
    extra_body = {"temperature": 0, **(extra or {})}
    return claude.messages.create(**{**body, **options}, extra_body=extra_body)


def raw_events(base_url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed message as it comes over the wire: (event name, data) pairs, pings included."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    try:
        conn.request("POST", "/v1/messages", json.dumps({**body, "stream": True}), headers)
        response = conn.getresponse()
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events, name = [], None
        for line in response.read().decode().splitlines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
        return events
    finally:
        conn.close()


def test_a_message_at_temperature_0_says_what_the_chat_completion_says(
    claude: anthropic.Anthropic, reference: Any, message: Any
) -> None:
    choice = reference.choices[0]
    assert message.id.startswith("msg_")
    assert (message.type, message.role, message.model) == ("message", "assistant", MODEL)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choice.message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice.finish_reason]
    assert message.stop_sequence is None
    assert message.usage.input_tokens == reference.usage.prompt_tokens
    assert message.usage.output_tokens == reference.usage.completion_tokens
    assert message._request_id.startswith("req-")

    # The system prompt as text blocks is the same system prompt.
    blocks = ask(claude, system=[{"type": "text", "text": SYSTEM}])
    assert blocks.content[0].text == choice.message.content


def test_a_streamed_message_is_the_message_in_anthropics_events(
    claude: anthropic.Anthropic, base_url: str, reference: Any, message: Any
) -> None:
    text = reference.choices[0].message.content
    body = {"model": MODEL, "system": SYSTEM, "messages": QUESTION, "max_tokens": MAX_TOKENS}
    events = raw_events(base_url, {**body, "temperature": 0})
    names = [name for name, _ in events]
    deltas = names[len(EVENT_ORDER) : -len(EVENT_END)]
    assert names[: len(EVENT_ORDER)] == EVENT_ORDER and names[-len(EVENT_END) :] == EVENT_END
    assert deltas and set(deltas) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start, block_start = events[0][1], events[1][1]
    assert start["message"]["content"] == [] and start["message"]["stop_reason"] is None
    assert start["message"]["usage"]["input_tokens"] == reference.usage.prompt_tokens
    assert block_start == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    pieces = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(piece["type"] == "text_delta" for piece in pieces)
    assert "".join(piece["text"] for piece in pieces) == text
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": message.stop_reason, "stop_sequence": None}
    assert end["usage"]["output_tokens"] == reference.usage.completion_tokens

    # The client's own stream helper assembles the same message.
    with claude.messages.stream(**body, extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == text
        assert stream.get_final_message().content[0].text == text


def test_a_stop_sequence_ends_the_message_and_is_named(
    claude: anthropic.Anthropic, base_url: str, reference: Any
) -> None:
    text = reference.choices[0].message.content
    words = text.split()
    stop = words[len(words) // 2]
    before = text[: text.index(stop)]
    assert before, "the stop sequence should cut the text, not empty it"

    message = ask(claude, stop_sequences=["no such text", stop])
    assert message.content[0].text == before
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.usage.output_tokens < reference.usage.completion_tokens

    body = {"model": MODEL, "system": SYSTEM, "messages": QUESTION, "max_tokens": MAX_TOKENS}
    events = raw_events(base_url, {**body, "temperature": 0, "stop_sequences": [stop]})
    streamed = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert streamed == before
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_max_tokens_ends_the_message_with_max_tokens(
    claude: anthropic.Anthropic, reference: Any
) -> None:
    message = ask(claude, max_tokens=3)
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert message.usage.output_tokens == 3
    assert reference.choices[0].message.content.startswith(message.content[0].text)


def test_a_final_assistant_message_is_continued(
    claude: anthropic.Anthropic, reference: Any
) -> None:
    """Anthropic's prefill: the reply goes on from the assistant's words, which it omits."""
    text = reference.choices[0].message.content
    prefill = " ".join(text.split()[:3])
    message = ask(claude, messages=[*QUESTION, {"role": "assistant", "content": prefill}])
    assert text.startswith(prefill + message.content[0].text)
    assert len(message.content[0].text) > 0

    with pytest.raises(anthropic.BadRequestError) as trailing:
        ask(claude, messages=[*QUESTION, {"role": "assistant", "content": prefill + " "}])
    assert trailing.value.body["error"]["message"].startswith("messages[1].content:")


def test_count_tokens_counts_the_prompt_the_message_uses(
    claude: anthropic.Anthropic, reference: Any
) -> None:
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    assert counted.input_tokens == reference.usage.prompt_tokens


def error_of(exc: anthropic.APIStatusError) -> dict[str, Any]:
    """The error object of an Anthropic-shaped error body."""
    body = exc.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["request_id"] == exc.response.headers["request-id"]
    return dict(body["error"])


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"temperature": 1.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(
    claude: anthropic.Anthropic, options: dict[str, Any], field: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        ask(claude, extra=options)
    error = error_of(bad.value)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}:")


def test_a_request_without_max_tokens_is_a_400(base_url: str) -> None:
    body = {"model": MODEL, "messages": QUESTION}
    headers = {"Authorization": f"Bearer {KEY}"}
    status, _, answer = request(base_url, "POST", "/v1/messages", body, headers=headers)
    assert status == 400
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"] == "max_tokens: is required"


def test_a_forced_tool_use_fits_its_schema_and_its_result_goes_back(
    claude: anthropic.Anthropic,
) -> None:
    weather = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    answer = ask(claude, max_tokens=48, tools=[weather], tool_choice={"type": "any"})
    assert answer.stop_reason == "tool_use"
    (use,) = [b for b in answer.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)
    follow = [
        *QUESTION,
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny, 24 C"}]},
    ]  # fmt: skip
    after = ask(claude, max_tokens=4, messages=follow, tools=[weather],
                tool_choice={"type": "none"})  # fmt: skip
    assert after.stop_reason in ("end_turn", "max_tokens") and after.content[0].type == "text"
    with pytest.raises(anthropic.BadRequestError) as refused:
        ask(claude, max_tokens=1, tools=[weather], tool_choice={"type": "tool", "name": "nope"})
    assert error_of(refused.value)["message"].startswith("tool_choice:")
    # No tools at all is a plain message.
    assert ask(claude, max_tokens=1, tools=[], tool_choice={"type": "auto"}).content


def test_errors_outside_validation_keep_anthropics_shape(
    claude: anthropic.Anthropic, base_url: str, live: LiveServer
) -> None:
    with pytest.raises(anthropic.NotFoundError) as unknown:
        ask(claude, model="claude-sonnet-4-5")
    assert error_of(unknown.value)["type"] == "not_found_error"

    stranger = anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        ask(stranger)
    assert error_of(unauthorized.value)["type"] == "authentication_error"

    # A full server answers Anthropic's 529 overloaded (the OpenAI API there keeps its 503).
    full = serve(live, max_in_flight=0)
    status, headers, body = request(full, "POST", "/v1/messages", {})
    assert (status, body["error"]["type"], headers["Retry-After"]) == (529, "overloaded_error", "1")
    status, _, body = request(full, "POST", "/v1/chat/completions", {})
    assert (status, body["error"]["type"]) == (503, "server_overloaded")

    small = serve(live, max_body_bytes=1024)
    too_large = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "x" * 2048}],
    }
    status, _, body = request(small, "POST", "/v1/messages", too_large)
    assert (status, body["error"]["type"]) == (413, "request_too_large")


def test_the_x_api_key_header_carries_the_key(base_url: str) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    status, _, _ = request(base_url, "POST", "/v1/messages", body, headers=headers)
    assert status == 200


VALID = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": QUESTION}
BAD_BODIES = one_bad_field(MessagesRequest, VALID) | one_bad_message(
    MessageParam, {k: v for k, v in VALID.items() if k != "messages"}, QUESTION[0]
)


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=BAD_BODIES)
def test_every_bad_field_is_a_4xx_in_anthropics_shape(base_url: str, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()  # NaN and huge integers go out as a careless client sends them
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(base_url + "/v1/messages", content=raw, headers=headers, timeout=60)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    answer = response.json()
    assert answer["type"] == "error" and answer["error"]["message"]
