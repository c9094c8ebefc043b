"""The official ``ollama`` Python client against the Ollama API under /api (embedded model, 2
stages, api key, alias "smollm"), on the same app as the OpenAI API.

Shown: /api/chat says at temperature 0 what /v1/chat/completions says, streamed (NDJSON, the
default) or not, with Ollama's counts and measured durations on the last line; /api/generate
with ``raw`` continues a prompt as /v1/completions does and ``num_predict`` bounds it, a
``template``'s placeholders are filled (any other Go action refused), no prompt is "loaded"; the
model is listed, shown and running under its alias; a ``format`` schema holds the answer to
the schema; a tool call the model writes comes back as ``message.tool_calls`` with its
arguments an object (Ollama has no ``tool_choice`` to force one: the conversation shows the
model a call, and the model calls again), and calls and tool results go back in the history;
model management and embeddings are refused in Ollama's ``{"error": ...}`` naming what to do;
the key is needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import ollama
import openai
import pytest

from mlxppd.http.ollama_api import add_ollama_routes
from mlxppd.http.openai_api import create_app
from tests.support.http import LiveServer

pytestmark = pytest.mark.slow

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 12}
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def url(embedded_model_dir: Path) -> Iterator[str]:
    server = LiveServer(embedded_model_dir, 2)
    try:
        app = create_app(server.backend, api_key=KEY, alias="smollm")
        add_ollama_routes(app)
        yield server.serve(app)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(url: str) -> ollama.Client:
    return ollama.Client(host=url, headers=AUTH, timeout=300)


def test_chat_says_what_the_chat_api_says_streamed_or_not(client: ollama.Client, url: str) -> None:
    chat_api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    expected = chat_api.chat.completions.create(
        model="smollm", messages=MESSAGES, max_tokens=12, temperature=0
    )
    answer = client.chat("smollm", MESSAGES, options=GREEDY)
    assert answer.message.content == expected.choices[0].message.content
    assert answer.done and answer.done_reason == "stop"
    assert answer.prompt_eval_count == expected.usage.prompt_tokens
    assert answer.eval_count == expected.usage.completion_tokens
    assert all(answer[d] > 0 for d in DURATIONS)
    assert answer.total_duration >= answer.prompt_eval_duration + answer.eval_duration

    parts = list(client.chat("smollm:latest", MESSAGES, stream=True, options=GREEDY))
    assert "".join(p.message.content for p in parts) == answer.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == answer.eval_count and parts[-1].done_reason == "stop"


def test_stream_is_the_default_as_ndjson(url: str) -> None:
    body = {"model": "smollm", "messages": MESSAGES, "options": {"num_predict": 2}}
    with httpx.stream("POST", url + "/api/chat", json=body, headers=AUTH, timeout=300) as r:
        assert r.status_code == 200
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "length"
    assert lines[-1]["eval_count"] == 2
    assert all(line["message"]["role"] == "assistant" for line in lines)


def test_generate_raw_continues_as_completions_and_num_predict_bounds_it(
    client: ollama.Client, url: str
) -> None:
    completions = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    prompt = "The capital of France is"
    expected = completions.completions.create(
        model="smollm", prompt=prompt, max_tokens=6, temperature=0
    )
    answer = client.generate(
        "smollm", prompt, raw=True, options={"temperature": 0, "num_predict": 6}
    )
    assert answer.response == expected.choices[0].text
    assert answer.done_reason == "length" and answer.eval_count == 6
    templated = client.generate(
        "smollm", "Name a color.", system="Answer in one word.",
        options={"temperature": 0, "num_predict": 3},
    )  # fmt: skip
    assert templated.eval_count <= 3 and templated.prompt_eval_count > answer.prompt_eval_count
    # A template's placeholders are filled: it prompts what the filled text prompts raw.
    one = {"num_predict": 1}
    filled = client.generate("smollm", "hi", template="Q: {{ .Prompt }}\nA:", options=one)
    assert (
        filled.prompt_eval_count
        == client.generate("smollm", "Q: hi\nA:", raw=True, options=one).prompt_eval_count
    )
    with pytest.raises(ollama.ResponseError) as go:
        client.generate("smollm", "hi", template="{{ if .System }}x{{ end }}{{ .Prompt }}")
    assert go.value.status_code == 400 and go.value.error.startswith("template:")
    # No prompt: Ollama's "load the model", answered at once.
    loaded = client.generate("smollm")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_the_model_is_listed_shown_and_running(client: ollama.Client, url: str) -> None:
    (listed,) = client.list().models
    assert listed.model == "smollm:latest" and listed.size > 0 and len(listed.digest) == 64
    assert listed.details.format == "safetensors" and listed.details.family == "llama"
    shown = client.show("smollm")
    assert shown.details.family == "llama" and "completion" in shown.capabilities
    assert shown.template and shown.modelinfo["general.architecture"] == "llama"
    (running,) = client.ps().models
    assert running.model == "smollm:latest" and running.context_length > 0
    version = httpx.get(url + "/api/version", headers=AUTH).json()
    assert version["version"].count(".") == 2


def test_a_format_schema_holds_the_answer(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    answer = client.chat("smollm", MESSAGES, format=schema, options={"num_predict": 24, "seed": 1})
    jsonschema.validate(json.loads(answer.message.content), schema)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_a_tool_call_comes_back_with_its_arguments_an_object(client: ollama.Client) -> None:
    # Ollama has no tool_choice: the call is the model's to make. This small model makes it
    # after seeing a call in the conversation (rendered as the chat API renders one).
    london = {"function": {"name": "get_weather", "arguments": {"city": "London"}}}
    history = [
        {"role": "user", "content": "Weather in London?"},
        {"role": "assistant", "content": "", "tool_calls": [london]},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    options = {"temperature": 0, "num_predict": 40}
    answer = client.chat("smollm", history, tools=[WEATHER], options=options)
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert answer.done_reason == "stop" and not answer.message.content
    parts = list(client.chat("smollm", history, tools=[WEATHER], stream=True, options=options))
    calls = [c for p in parts for c in p.message.tool_calls or ()]
    assert calls == answer.message.tool_calls
    assert "<tool_call>" not in "".join(p.message.content for p in parts)

    # The call and the tool's result go back in the history, and reach the prompt.
    paris = {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "content": "sunny, 25 C", "tool_name": "get_weather"}
    one = {"num_predict": 1}
    called = client.chat("smollm", [*history, paris], tools=[WEATHER], options=one)
    answered = client.chat("smollm", [*history, paris, result], tools=[WEATHER], options=one)
    assert answered.prompt_eval_count > called.prompt_eval_count > answer.prompt_eval_count


def test_refusals_are_ollama_errors_naming_the_fix(client: ollama.Client, url: str) -> None:
    with pytest.raises(ollama.ResponseError) as pulled:
        client.pull("smollm")
    assert pulled.value.status_code == 400 and "mlxppctl prepare" in pulled.value.error
    with pytest.raises(ollama.ResponseError) as embedded:
        client.embed("smollm", "hello")
    assert embedded.value.status_code == 404 and "embeddings are not served" in embedded.value.error
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat("smollm", MESSAGES, options={"mirostat": 2})
    assert unknown.value.status_code == 400 and "mirostat" in unknown.value.error
    with pytest.raises(ollama.ResponseError) as typo:
        client.chat("smollm", MESSAGES, options={"temprature": 0})
    assert typo.value.status_code == 400 and "temprature" in typo.value.error
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat("llama3", MESSAGES)
    assert missing.value.status_code == 404 and "smollm" in missing.value.error
    body = httpx.post(url + "/api/show", json={"model": "llama3"}, headers=AUTH).json()
    assert list(body) == ["error"] and isinstance(body["error"], str)
    unrouted = httpx.get(url + "/api/blobs/sha256:00", headers=AUTH)
    assert unrouted.status_code == 404 and list(unrouted.json()) == ["error"]


def test_the_key_is_needed(url: str) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=url).list()
    assert refused.value.status_code == 401
