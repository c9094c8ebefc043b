"""Inputs built to cost the server: a prompt too long for the context by its characters alone is
refused before it is tokenized (naming the limit), a big input is tokenized on a lane of its
own, and a JSON schema is bounded on exactly the text the last stage compiles, so one that fits
compact but not as used is a 400 naming the limit, never a 500.

A live server over the embedded SmolLM2 (a context of 8192 tokens; its longest token has 81
characters), spoken to over plain HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxppd.core.protocol.sampling import MAX_SCHEMA_BYTES
from mlxppd.http.anthropic_api import add_anthropic_routes
from mlxppd.http.api_state import BULK_INPUT_BYTES, BULK_THREAD, STATE
from mlxppd.http.openai_api import create_app
from tests.support.http import LiveServer, post

CONTEXT = 8192
MESSAGE = {"role": "user", "content": "hi"}
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def live(embedded_model_dir: Path) -> Iterator[tuple[LiveServer, str, Any]]:
    server = LiveServer(embedded_model_dir)
    app = create_app(server.backend)
    add_anthropic_routes(app)
    try:
        yield server, server.serve(app), app
    finally:
        server.stop()


@pytest.fixture(scope="module")
def url(live: tuple[LiveServer, str, Any]) -> str:
    return live[1]


def tools(count: int, description: str) -> list[dict[str, Any]]:
    """``count`` functions, each one string parameter described by ``description``."""
    parameters = {"type": "object", "properties": {"p": {"type": "string", "description": ""}}}
    out = []
    for i in range(count):
        schema = {**parameters, "properties": {"p": {"type": "string", "description": description}}}
        out.append({"type": "function", "function": {"name": f"f{i}", "parameters": schema}})
    return out


def refused(status: int, body: dict[str, Any], code: str) -> str:
    assert status == 400, body
    error = body["error"]
    assert error.get("code", code) == code, body
    return str(error["message"])


# --- the prompt's length, before tokenizing ---


def test_a_huge_tool_list_is_refused_by_its_length_before_it_is_tokenized(url: str) -> None:
    """3.7 MiB of tools took the shared tokenizer thread 12 s to tokenize, and only then did the
    context check refuse them; now their characters alone refuse them."""
    huge = tools(128, "w" * 29_000)
    body = {"messages": [MESSAGE], "tools": huge, "max_tokens": 4}
    status, answer = post(url, "/v1/chat/completions", body)
    message = refused(status, answer, "context_length_exceeded")
    assert "characters" in message and f"{CONTEXT} tokens" in message, message
    assert answer["error"]["param"] == "messages"


def test_the_messages_api_refuses_a_huge_tool_list_the_same_way(url: str) -> None:
    huge = [
        {"name": f"f{i}", "input_schema": {"type": "object", "description": "w" * 29_000}}
        for i in range(128)
    ]
    counted = {"model": "smollm2-135m", "messages": [MESSAGE], "tools": huge}
    for path, body in (("/v1/messages", {**counted, "max_tokens": 4}),
                       ("/v1/messages/count_tokens", counted)):  # fmt: skip
        status, answer = post(url, path, body)
        assert status == 400, answer
        assert answer["type"] == "error"
        assert "characters" in answer["error"]["message"], answer


def test_a_long_completions_prompt_is_refused_by_its_length(url: str) -> None:
    status, answer = post(url, "/v1/completions", {"prompt": "a " * 400_000, "max_tokens": 4})
    message = refused(status, answer, "context_length_exceeded")
    assert "800000 characters" in message and f"{CONTEXT} tokens" in message
    assert answer["error"]["param"] == "prompt"


def test_a_prompt_within_the_length_bound_is_still_held_to_the_context_in_tokens(
    url: str,
) -> None:
    status, answer = post(url, "/v1/completions", {"prompt": "word " * 20_000, "max_tokens": 4})
    message = refused(status, answer, "context_length_exceeded")
    assert "the prompt has" in message and "characters" not in message


def test_a_big_input_is_tokenized_on_the_bulk_lane_and_a_small_one_on_the_shared_one(
    live: tuple[LiveServer, str, Any],
) -> None:
    server, _, app = live
    state = app[STATE]

    def where() -> str:
        return threading.current_thread().name

    assert server.call(state.off_loop(where, size=BULK_INPUT_BYTES + 1)).startswith(BULK_THREAD)
    assert not server.call(state.off_loop(where, size=BULK_INPUT_BYTES)).startswith(BULK_THREAD)


# --- schemas, measured as used ---


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_a_schema_that_fits_compact_but_not_as_the_stage_takes_it_is_a_400(url: str) -> None:
    """25,000 'é' are 50 KB of compact UTF-8 JSON but 150 KB as the escaped JSON the stage
    compiles; that was a 500."""
    schema = {"type": "object", "description": "é" * 25_000}
    body = {"messages": [MESSAGE], "max_tokens": 4, "response_format": schema_format(schema)}
    status, answer = post(url, "/v1/chat/completions", body)
    message = refused(status, answer, "invalid_value")
    assert str(MAX_SCHEMA_BYTES) in message, message
    assert answer["error"]["param"].startswith("response_format")


def test_a_schema_within_the_bound_as_used_is_served(url: str) -> None:
    schema = {"type": "object", "description": "é" * 5_000}
    body = {
        "messages": [MESSAGE], "max_tokens": 4, "temperature": 0,
        "response_format": schema_format(schema),
    }  # fmt: skip
    status, answer = post(url, "/v1/chat/completions", body)
    assert status == 200, answer


def test_a_forced_call_whose_tools_together_exceed_the_schema_bound_is_a_400(url: str) -> None:
    """Each tool's schema fits; the one call schema over both does not (it was a 500). The
    descriptions are one long token repeated, so the prompt itself fits the context."""
    both = tools(2, "#" * 40_000)
    body = {"messages": [MESSAGE], "tools": both, "tool_choice": "required", "max_tokens": 4}
    status, answer = post(url, "/v1/chat/completions", body)
    message = refused(status, answer, "invalid_value")
    assert str(MAX_SCHEMA_BYTES) in message and "forced tool call" in message, message
    assert answer["error"]["param"] == "tool_choice"
