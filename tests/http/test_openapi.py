"""The OpenAPI document: checked in and current, a valid OpenAPI 3.1 document, served at
/openapi.json, and true of a live server (the OpenAI API and the Anthropic Messages API): real
responses validate against the response models and the document, and schemathesis's generated
requests get no 5xx and only documented responses."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import pytest
from aiohttp import web
from jsonschema import Draft202012Validator
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from mlxppd.app.api_app import api_app
from mlxppd.http import anthropic_models as claude
from mlxppd.http.api_models import (
    ChatCompletion,
    ChatCompletionChunk,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TextCompletion,
    TextCompletionChunk,
)
from mlxppd.http.openapi import OPENAPI_PATH, openapi_document, openapi_text
from mlxppd.runtime.observability.metrics import PipelineMetrics
from tests.support.http import LiveServer, post, request, stream
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
CHECKED_IN = ROOT / "docs" / "openapi.json"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES_PATH = claude.MESSAGES_PATH
COUNT_TOKENS = claude.COUNT_TOKENS_PATH
MODEL = "smollm2-135m"  # LiveServer's model id
KEY = "sesame"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
#: prompt + max_tokens: small, so that a generated max_tokens in the millions is a quick 400
CONTEXT_TOKENS = 64
#: examples schemathesis generates per operation (MLXPP_FUZZ_EXAMPLES for a longer run; the
#: suite's default keeps its CPU within the 15-minute bound)
FUZZ_EXAMPLES = int(os.environ.get("MLXPP_FUZZ_EXAMPLES", "10"))
NEGATIVE_EXAMPLES = max(1, FUZZ_EXAMPLES // 2)
NEW_ROUTE_EXAMPLES = max(1, FUZZ_EXAMPLES // 2)
RESPONSES = "/v1/responses"

DOC = openapi_document()


def app_of(backend: Any, **options: Any) -> web.Application:
    """The coordinator's whole API, as ``mlxppd serve`` builds it: the document's subject."""
    return api_app(backend, **options)


def conforms(model: type[BaseModel], body: Any) -> None:
    """``body`` is a ``model``, and valid against the document's schema of the same name."""
    model.model_validate(body)
    schema = {"$ref": f"#/components/schemas/{model.__name__}", "components": DOC["components"]}
    errors = sorted(Draft202012Validator(schema).iter_errors(body), key=str)
    assert not errors, f"{model.__name__}: {errors[0].message} at {list(errors[0].path)}"


# --- the document itself ---


def test_checked_in_document_is_current() -> None:
    assert CHECKED_IN.read_text(encoding="utf-8") == openapi_text(), (
        "docs/openapi.json is stale; run: python scripts/gen_openapi.py"
    )


def test_gen_script_check_passes() -> None:
    spec = importlib.util.spec_from_file_location("gen_openapi", ROOT / "scripts/gen_openapi.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0


def test_document_is_valid_openapi_3_1() -> None:
    from openapi_spec_validator import OpenAPIV31SpecValidator, validate

    assert DOC["openapi"] == "3.1.0"
    validate(DOC, cls=OpenAPIV31SpecValidator)
    assert openapi_document() == DOC  # deterministic
    assert json.loads(openapi_text()) == DOC


def test_every_route_is_documented() -> None:
    backend = SimpleNamespace(model_id=MODEL)
    app = app_of(backend, metrics=PipelineMetrics(CollectorRegistry()))
    routes = {
        (r.method.lower(), r.resource.canonical.replace("{model:.+}", "{model}"))
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    documented = {(method, path) for path, item in DOC["paths"].items() for method in item}
    assert routes == documented


def test_request_and_response_schemas_are_components() -> None:
    schemas = DOC["components"]["schemas"]
    for name in (
        "ChatCompletionRequest",
        "CompletionRequest",
        "ChatMessage",
        "ChatCompletion",
        "ChatCompletionChunk",
        "TextCompletion",
        "TextCompletionChunk",
        "ModelList",
        "Health",
        "ErrorResponse",
        "MessagesRequest",
        "CountTokensRequest",
        "Message",
        "MessageTokensCount",
        "MessageStartEvent",
        "ContentBlockDeltaEvent",
        "AnthropicError",
    ):
        assert name in schemas, name
    refs = set(json.dumps(DOC).split('"$ref": "')[1:])
    for ref in refs:
        target = ref.split('"', 1)[0]
        assert target.startswith("#/components/schemas/"), target
        assert target.rsplit("/", 1)[1] in schemas, target


def test_security_is_bearer_on_v1_only() -> None:
    """The key guards /v1/*, Ollama's /api/* and /metrics; the Messages API also takes it as
    x-api-key."""
    for path, item in DOC["paths"].items():
        for operation in item.values():
            keyed = path.startswith(("/v1/", "/api/")) or path == "/metrics"
            bearer: dict[str, list[str]] = {"bearerAuth": []}
            if path.startswith(MESSAGES_PATH):
                assert operation["security"] == [bearer, {"apiKeyHeader": []}], path
            else:
                assert (operation["security"] == [bearer]) == keyed, path
    assert DOC["paths"][OPENAPI_PATH]["get"]["security"] == []


def test_extra_paths_are_added_and_never_replace() -> None:
    class Extra(BaseModel):
        text: str

    item = {"post": {"responses": {"200": {"description": "ok"}}}}
    doc = openapi_document({"/v1/extra": item}, [(Extra, "serialization")])
    assert doc["paths"]["/v1/extra"] == item
    assert "Extra" in doc["components"]["schemas"]
    with pytest.raises(ValueError, match="already"):
        openapi_document({CHAT: item})


def test_sse_event_schema_takes_done_chunks_and_errors() -> None:
    event = DOC["paths"][CHAT]["post"]["responses"]["200"]["content"]["text/event-stream"]
    data = event["schema"]["properties"]["data"]
    assert data["if"] == {"const": "[DONE]"}
    assert data["else"]["contentMediaType"] == "application/json"
    assert data["else"]["contentSchema"] == {
        "anyOf": [
            {"$ref": "#/components/schemas/ChatCompletionChunk"},
            {"$ref": "#/components/schemas/ErrorResponse"},
        ]
    }


# --- a live server ---


@pytest.fixture(scope="module")
def live(embedded_model_dir: Path) -> Iterator[tuple[LiveServer, str]]:
    server = LiveServer(embedded_model_dir, 2)
    try:
        app = app_of(server.backend, default_max_tokens=8, max_context_tokens=CONTEXT_TOKENS)
        yield server, server.serve(app)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def url(live: tuple[LiveServer, str]) -> str:
    return live[1]


@pytest.fixture(scope="module")
def keyed_url(live: tuple[LiveServer, str]) -> str:
    """The same limits, under an api key: the document's bearer security holds there."""
    server, _ = live
    app = app_of(
        server.backend, api_key=KEY, default_max_tokens=8, max_context_tokens=CONTEXT_TOKENS
    )
    return server.serve(app)


def _check_chat_logprobs(logprobs: dict[str, Any] | None, top: int) -> None:
    assert logprobs is not None
    for token in logprobs["content"]:
        assert len(token["top_logprobs"]) == top


@pytest.mark.slow
def test_chat_response_conforms(url: str) -> None:
    status, body = post(
        url,
        CHAT,
        {"messages": MESSAGES, "max_tokens": 6, "n": 2, "logprobs": True, "top_logprobs": 3,
         "seed": 7},
    )  # fmt: skip
    assert status == 200, body
    conforms(ChatCompletion, body)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        _check_chat_logprobs(choice["logprobs"], 3)


@pytest.mark.slow
def test_chat_stream_chunks_conform(url: str) -> None:
    status, events = stream(
        url,
        CHAT,
        {"messages": MESSAGES, "max_tokens": 6, "n": 2, "logprobs": True, "top_logprobs": 2,
         "seed": 7, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert status == 200, events
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        conforms(ChatCompletionChunk, chunk)
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in choice_chunks)
    roles = [c for c in choice_chunks if c["choices"][0]["delta"].get("role")]
    finishes = [c for c in choice_chunks if c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["index"] for c in roles) == [0, 1]
    assert sorted(c["choices"][0]["index"] for c in finishes) == [0, 1]
    with_logprobs = [c for c in choice_chunks if c["choices"][0]["logprobs"]]
    assert with_logprobs
    for chunk in with_logprobs:
        _check_chat_logprobs(chunk["choices"][0]["logprobs"], 2)


@pytest.mark.slow
def test_completion_response_conforms(url: str) -> None:
    status, body = post(
        url, COMPLETIONS, {"prompt": "The sea is", "max_tokens": 6, "n": 2, "logprobs": 3}
    )
    assert status == 200, body
    conforms(TextCompletion, body)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"])
        assert len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["text_offset"])


@pytest.mark.slow
@pytest.mark.parametrize("usage", [True, False])
def test_completion_stream_chunks_conform(url: str, usage: bool) -> None:
    body: dict[str, Any] = {"prompt": [504, 3458, 314], "max_tokens": 5, "n": 2, "logprobs": 2}
    if usage:
        body["stream_options"] = {"include_usage": True}
    status, events = stream(url, COMPLETIONS, body)
    assert status == 200, events
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        conforms(TextCompletionChunk, chunk)
        assert ("usage" in chunk) == usage
    finishes = [c for c in events[:-1] if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["index"] for c in finishes) == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CHAT, {"messages": MESSAGES, "temperature": 3}, 400, "temperature"),
        (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
        (CHAT, {"messages": MESSAGES, "max_tokens": "8"}, 400, "max_tokens"),
        (CHAT, {}, 400, "messages"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "echo": True}, 400, "echo"),
        (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ],
)
def test_errors_conform_and_name_the_parameter(
    url: str, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    got, headers, error = request(url, "POST", path, body)
    assert got == status, error
    conforms(ErrorResponse, error)
    assert error["error"]["param"] == param
    assert headers.get("X-Request-Id")


@pytest.mark.slow
def test_tool_call_response_conforms(live: tuple[LiveServer, str]) -> None:
    server, _ = live
    roomy = server.serve(app_of(server.backend, max_context_tokens=512))  # tools: ~140 tokens
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    status, body = post(
        roomy,
        CHAT,
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool],
         "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
         "max_tokens": 24, "temperature": 0},
    )  # fmt: skip
    assert status == 200, body
    conforms(ChatCompletion, body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


# --- the Anthropic Messages API on the same server ---

TOOL = {
    "name": "get_weather",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ASK = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}


def conforms_event(event: dict[str, Any]) -> None:
    """A stream event is the model its ``type`` names, and valid under the document."""
    kinds = {get_args(m.model_fields["type"].annotation)[0]: m for m in claude.STREAM_EVENTS}
    conforms(kinds[event["type"]], event)


@pytest.mark.slow
def test_a_message_and_a_tool_use_conform(live: tuple[LiveServer, str]) -> None:
    server, _ = live
    roomy = server.serve(app_of(server.backend, max_context_tokens=512))  # tools: ~140 tokens
    status, body = post(roomy, MESSAGES_PATH, {**ASK, "stop_sequences": ["zzz"]})
    assert status == 200, body
    conforms(claude.Message, body)
    assert body["content"][0]["type"] == "text" and body["stop_reason"] in (
        "end_turn",
        "max_tokens",
    )
    forced = {**ASK, "max_tokens": 48, "tools": [TOOL],
              "tool_choice": {"type": "tool", "name": "get_weather"}}  # fmt: skip
    status, body = post(roomy, MESSAGES_PATH, forced)
    assert status == 200, body
    conforms(claude.Message, body)
    assert body["stop_reason"] == "tool_use"
    assert [b["name"] for b in body["content"] if b["type"] == "tool_use"] == ["get_weather"]
    status, events = stream(roomy, MESSAGES_PATH, forced)
    assert status == 200, events
    for event in events:
        conforms_event(event)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"tool_use"} == {
        e["content_block"]["type"] for e in events if e["type"] == "content_block_start"
    } - {"text"}


@pytest.mark.slow
def test_a_streamed_message_and_a_token_count_conform(url: str) -> None:
    status, events = stream(url, MESSAGES_PATH, ASK)
    assert status == 200, events
    for event in events:
        conforms_event(event)
    assert [e["type"] for e in events][:3] == ["message_start", "content_block_start", "ping"]
    status, body = post(url, COUNT_TOKENS, {"model": MODEL, "messages": MESSAGES})
    assert status == 200, body
    conforms(claude.MessageTokensCount, body)
    assert body["input_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        (MESSAGES_PATH, {**ASK, "temperature": 3}, 400, "temperature"),
        (MESSAGES_PATH, {k: v for k, v in ASK.items() if k != "max_tokens"}, 400, "max_tokens"),
        (MESSAGES_PATH, {**ASK, "model": "claude-9"}, 404, "model"),
        (MESSAGES_PATH, {**ASK, "max_tokens": 10**5}, 400, "max_tokens"),
        (COUNT_TOKENS, {"model": MODEL, "messages": []}, 400, "messages"),
    ],
)
def test_anthropic_errors_conform_and_name_the_field(
    url: str, path: str, body: dict[str, Any], status: int, field: str
) -> None:
    got, headers, error = request(url, "POST", path, body)
    assert got == status, error
    conforms(claude.AnthropicError, error)
    assert error["error"]["message"].startswith(f"{field}:"), error
    assert headers.get("X-Request-Id") == error["request_id"]


@pytest.mark.slow
def test_a_cross_field_error_names_the_parameter(url: str) -> None:
    status, error = post(url, CHAT, {"messages": MESSAGES, "top_logprobs": 2})
    assert status == 400, error
    conforms(ErrorResponse, error)
    assert error["error"]["param"] == "top_logprobs"


@pytest.mark.slow
def test_models_health_and_document_conform(url: str) -> None:
    status, _, body = request(url, "GET", "/v1/models")
    assert status == 200
    conforms(ModelList, body)
    status, _, body = request(url, "GET", f"/v1/models/{MODEL}")
    assert status == 200
    conforms(ModelCard, body)
    status, _, body = request(url, "GET", "/v1/models/nope")
    assert status == 404
    conforms(ErrorResponse, body)
    status, _, body = request(url, "GET", "/health")
    assert status == 200
    conforms(Health, body)
    assert set(body) == {"status", "model", "detail", "stages"}
    status, headers, body = request(url, "GET", OPENAPI_PATH)
    assert status == 200
    assert headers["Content-Type"].startswith("application/json")
    assert body == DOC


@pytest.mark.slow
def test_document_is_public_when_the_api_is_keyed(live: tuple[LiveServer, str]) -> None:
    server, _ = live
    keyed = server.serve(app_of(server.backend, api_key=KEY))
    status, _, body = request(keyed, "GET", OPENAPI_PATH)
    assert status == 200 and body == DOC
    status, headers, body = request(keyed, "GET", "/v1/models")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    conforms(ErrorResponse, body)
    status, _, body = request(keyed, "GET", "/health")
    assert status == 200 and body == {"status": "ok"}
    conforms(Health, body)


# --- schemathesis ---


def _checks(negative: bool = False) -> list[Any]:
    """Every response documented and conforming (status, content type, headers, body), none a
    5xx; for negative data also schemathesis's check that the server refuses what it should."""
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]
    return [*checks, negative_data_rejection] if negative else checks


def _operation(path: str, method: str = "POST") -> Any:
    """The operation, with schemathesis sending the api key where the document asks for it."""
    import schemathesis

    config = schemathesis.Config.from_str(f'[auth.openapi.bearerAuth]\nbearer = "{KEY}"\n')
    return schemathesis.openapi.from_dict(openapi_document(), config=config)[path][method]


def _clamp(body: Any, path: str = CHAT) -> None:
    """At most 2 choices of 2 tokens (4 on the Responses API), asked for when none is (a
    generated n=16 of the whole context takes a minute on two cores): a test, not a benchmark."""
    if not isinstance(body, dict):
        return
    if path == RESPONSES:  # its own budget's name, and no other field is taken
        if not isinstance(body.get("max_output_tokens"), int) or body["max_output_tokens"] > 4:
            body["max_output_tokens"] = 4
        return
    if path.startswith("/api/"):  # Ollama's: options.num_predict
        options = body.setdefault("options", {})
        if isinstance(options, dict):
            predict = options.get("num_predict")
            if not isinstance(predict, int) or not 0 <= predict <= 2:
                options["num_predict"] = 2
        return
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2
    for field, most in (("max_tokens", 2), ("max_completion_tokens", 2), ("n", 2)):
        if isinstance(body.get(field), int | float) and body[field] > most:
            body[field] = most


def _steer(body: Any) -> None:
    """Nudge a generated body towards one the server generates for, keeping it valid under
    the document: the one model served (a random name is a 404 before anything else is
    looked at), text where messages have none (the document allows a message without
    content; the server wants it but on an assistant's tool calls), one prompt, not empty."""
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = MODEL
    for message in body.get("messages") or ():
        if isinstance(message, dict) and message.get("content") is None:
            message["content"] = "Hi."
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        body["prompt"] = prompt[:1]  # the document allows a batch; the server takes one
    if prompt in ("", [], [""]):
        body["prompt"] = "Hi."


def _fuzz(
    url: str, path: str, mode: str, examples: int, method: str = "POST", steer: bool = False
) -> dict[int, int]:
    """Send ``examples`` requests schemathesis generates for ``path``, each checked by
    ``_checks``; the counts of the statuses seen. Positive cases go through ``_clamp``, and
    with ``steer`` through ``_steer``, before they are sent."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    generation = schemathesis.GenerationMode(mode)
    checks = _checks(negative=mode == "negative")
    seen: dict[int, int] = {}

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_operation(path, method).as_strategy(generation_mode=generation))
    def run(case: Any) -> None:
        if mode == "positive":
            _clamp(case.body, path)
        if steer:
            _steer(case.body)
        response = case.call(base_url=url, timeout=120)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        case.validate_response(response, checks=checks)

    run()
    print(f"{method} {path} {mode}{' steered' if steer else ''}: statuses {seen}")
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES_PATH, COUNT_TOKENS])
@pytest.mark.parametrize("steer", [False, True], ids=["as-generated", "steered"])
def test_schemathesis_positive(keyed_url: str, path: str, steer: bool) -> None:
    seen = _fuzz(keyed_url, path, "positive", FUZZ_EXAMPLES, steer=steer)
    assert not any(status >= 500 for status in seen), seen
    if steer:
        assert seen.get(200), f"no steered request was answered 200: {seen}"


@pytest.mark.slow
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES_PATH, COUNT_TOKENS])
def test_schemathesis_negative(keyed_url: str, path: str) -> None:
    seen = _fuzz(keyed_url, path, "negative", NEGATIVE_EXAMPLES)
    assert not any(status >= 500 for status in seen), seen
    assert seen.get(400), seen


@pytest.mark.slow
@pytest.mark.parametrize("path", [RESPONSES, "/api/chat", "/api/generate", "/api/show"])
@pytest.mark.parametrize("mode", ["positive", "steered", "negative"])
def test_schemathesis_on_the_responses_and_ollama_apis(
    keyed_url: str, path: str, mode: str
) -> None:
    steer = mode == "steered"
    seen = _fuzz(keyed_url, path, "positive" if steer else mode, NEW_ROUTE_EXAMPLES, steer=steer)
    assert not any(status >= 500 for status in seen), seen
    if steer and path != "/api/show":
        assert seen.get(200), f"no steered request was answered 200: {seen}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    ["/v1/models", "/v1/models/{model}", "/health", OPENAPI_PATH, "/v1/responses/{response_id}",
     "/api/tags", "/api/version", "/api/ps"],
)  # fmt: skip
def test_schemathesis_get(keyed_url: str, path: str) -> None:
    seen = _fuzz(keyed_url, path, "positive", 5, method="GET")
    assert not any(status >= 500 for status in seen), seen


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}),
        (COMPLETIONS, {"prompt": "The sea is", "logprobs": 2}),
    ],
)
def test_schemathesis_takes_real_responses_and_refuses_a_tampered_one(
    keyed_url: str, path: str, body: dict[str, Any]
) -> None:
    """The document's schemas are enforced, the event stream's too: real responses (JSON and
    server-sent events, n=2, logprobs, usage) pass every check, one unknown field fails."""
    from schemathesis import Response
    from schemathesis.core.failures import FailureGroup

    operation = _operation(path)
    body = {**body, "max_tokens": 4, "n": 2}
    for streaming in (False, True):
        extra = {"stream": True, "stream_options": {"include_usage": True}} if streaming else {}
        case = operation.Case(body={**body, **extra}, media_type="application/json")
        response = case.call(
            base_url=keyed_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
        )
        assert response.status_code == 200, response.text
        case.validate_response(response, checks=_checks())
        tampered = response.content.replace(b'"model":', b'"surprise":1,"model":', 1)
        tampered = tampered.replace(b'"model": ', b'"surprise": 1, "model": ', 1)
        assert tampered != response.content
        bad = Response(
            response.status_code,
            response.headers,
            tampered,
            response.request,
            response.elapsed,
            response.verify,
            encoding=response.encoding,
        )
        with pytest.raises(FailureGroup):
            case.validate_response(bad, checks=_checks())
