"""A tool call the length limit cuts off comes back as a call, never as text: OpenAI's chat
as a partial ``tool_calls`` entry with ``finish_reason: "length"``, Anthropic's Messages as a
``tool_use`` block (its input as far as it went) with ``stop_reason: "max_tokens"``, streamed
and not. (It came back as ``content: "<tool_call>{\\"name\\": \\"get_</tool_call>"``.) The real
openai and anthropic SDKs against a live server on the embedded model; the call is forced, and
``CUT`` tokens end it inside its arguments."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.support.http import LiveServer

pytestmark = pytest.mark.slow

KEY = "test-key"
#: tokens that end the forced call after its name, inside its arguments
CUT = 16
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city", "unit"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def base_url(embedded_model_dir: Path) -> Iterator[str]:
    server = LiveServer(embedded_model_dir, 1)
    try:
        yield server.start_api(api_key=KEY, alias="smollm")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def chat(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def messages(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)


def chat_call(chat: openai.OpenAI, max_tokens: int, **extra: Any) -> Any:
    return chat.chat.completions.create(
        model="smollm",
        messages=ASK,  # type: ignore[arg-type]
        tools=[{"type": "function", "function": WEATHER}],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=max_tokens,
        temperature=0,
        **extra,
    )


@pytest.fixture(scope="module")
def whole(chat: openai.OpenAI) -> Any:
    """The forced call, greedy, with room to finish (asked once for the module)."""
    return chat_call(chat, 64).choices[0]


@pytest.fixture(scope="module")
def cut_choice(chat: openai.OpenAI) -> Any:
    """The forced call, greedy, cut after ``CUT`` tokens (asked once for the module)."""
    return chat_call(chat, CUT).choices[0]


def test_the_whole_call_parses_when_nothing_cuts_it(whole: Any) -> None:
    assert whole.finish_reason == "tool_calls"
    arguments = json.loads(whole.message.tool_calls[0].function.arguments)
    assert {"city", "unit"} <= set(arguments)


def test_openai_chat_returns_the_cut_call_with_finish_reason_length(
    cut_choice: Any, whole: Any
) -> None:
    choice = cut_choice
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut: it is not whole
    whole_arguments = whole.message.tool_calls[0].function.arguments
    # What came is what the whole one begins with.
    assert whole_arguments.startswith(call.function.arguments)


def test_openai_chat_streams_the_cut_call_and_no_text(chat: openai.OpenAI, cut_choice: Any) -> None:
    chunks = list(chat_call(chat, CUT, stream=True))
    plain = cut_choice
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(not d.content for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert [t.function.name for t in calls] == ["get_weather"]
    assert calls[0].function.arguments == plain.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"
    # No empty content deltas while the call is held back: the role chunk, the call, the end.
    assert len(deltas) == 3


def anthropic_ask(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "smollm",
        "max_tokens": max_tokens,
        "messages": ASK,
        "tools": [
            {
                "name": WEATHER["name"],
                "description": WEATHER["description"],
                "input_schema": WEATHER["parameters"],
            }
        ],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": {"temperature": 0},  # this SDK has no temperature parameter any more
    }


def anthropic_call(messages: anthropic.Anthropic, max_tokens: int) -> anthropic.types.Message:
    return messages.messages.create(**anthropic_ask(max_tokens))


@pytest.fixture(scope="module")
def anthropic_cut(messages: anthropic.Anthropic) -> anthropic.types.Message:
    """The forced call through the Messages API, cut after ``CUT`` tokens (asked once)."""
    return anthropic_call(messages, CUT)


def test_anthropic_returns_the_cut_call_as_tool_use_with_max_tokens(
    anthropic_cut: anthropic.types.Message, whole: Any
) -> None:
    # (An uncut Messages tool call, stop_reason "tool_use": tests/http/test_sampling_api.py.)
    cut = anthropic_cut
    assert cut.stop_reason == "max_tokens"
    assert [b.type for b in cut.content] == ["tool_use"]
    block = cut.content[0]
    assert block.type == "tool_use" and block.name == "get_weather"
    assert isinstance(block.input, dict)
    assert set(block.input) <= set(json.loads(whole.message.tool_calls[0].function.arguments))


def test_anthropic_streams_the_cut_call_as_tool_use(
    messages: anthropic.Anthropic, anthropic_cut: anthropic.types.Message
) -> None:
    plain = anthropic_cut
    with messages.messages.stream(**anthropic_ask(CUT)) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in uses] == [
        (b.name, b.input) for b in plain.content if b.type == "tool_use"
    ]
    assert not any(b.type == "text" and b.text for b in final.content)


def responses_call(chat: openai.OpenAI, max_tokens: int, stream: bool = False) -> Any:
    return chat.responses.create(
        model="smollm",
        input=ASK[0]["content"],
        tools=[{"type": "function", **WEATHER}],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=max_tokens,
        temperature=0,
        stream=stream,
    )


def test_responses_return_the_cut_call_as_an_incomplete_function_call(chat: openai.OpenAI) -> None:
    response = responses_call(chat, CUT)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.status == "incomplete" and item.arguments.startswith("{")

    events = list(responses_call(chat, CUT, stream=True))
    assert events[-1].type == "response.incomplete"
    (streamed,) = events[-1].response.output
    assert (streamed.type, streamed.status, streamed.arguments) == (
        "function_call",
        "incomplete",
        item.arguments,
    )
    assert not [e for e in events if e.type == "response.output_text.delta"]
