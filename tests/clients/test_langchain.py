"""LangChain's OpenAI chat model (``langchain-openai``'s ``ChatOpenAI``) against the live 2-stage
cluster: ``base_url`` is the coordinator's ``/v1``, ``api_key`` the server's key.

Shown: ``invoke`` returns an ``AIMessage`` with its usage; ``stream`` yields chunks that add up
to one message, usage included; ``bind_tools(..., tool_choice=name, strict=True)`` returns the
call in ``AIMessage.tool_calls`` with its arguments parsed; ``with_structured_output(Model)``
(its default method, ``response_format`` json_schema) returns the model. LangSmith tracing is
off (``conftest.py``), so nothing leaves loopback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.clients import asks
from tests.clients.conftest import LiveCluster
from tests.clients.loopback import LoopbackGuard

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]


@pytest.fixture(scope="module")
def chat(loopback_only: LoopbackGuard, live_cluster: LiveCluster) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=live_cluster.v1,
        api_key=live_cluster.key,  # type: ignore[arg-type]
        model=live_cluster.model,
        temperature=0,
        max_tokens=asks.CHAT_TOKENS,  # type: ignore[call-arg]
        max_retries=0,
        timeout=120,
        stream_usage=True,
    )


@pytest.fixture(scope="module")
def longer(chat: ChatOpenAI) -> ChatOpenAI:
    """Room for a tool call's or an object's JSON to close."""
    return chat.model_copy(update={"max_tokens": asks.JSON_TOKENS})


def test_invoke_returns_an_ai_message(chat: ChatOpenAI, live_cluster: LiveCluster) -> None:
    from langchain_core.messages import AIMessage

    message = chat.invoke(asks.HELLO)
    assert isinstance(message, AIMessage)
    assert isinstance(message.content, str) and message.content
    assert message.tool_calls == []
    assert message.response_metadata["model_name"] == live_cluster.model
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    assert message.usage_metadata is not None
    assert 0 < message.usage_metadata["output_tokens"] <= asks.CHAT_TOKENS


def test_stream_chunks_add_up_to_one_message(chat: ChatOpenAI) -> None:
    from langchain_core.messages import AIMessageChunk

    chunks = list(chat.stream(asks.HELLO))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    texts = [c.content for c in chunks if c.content]
    assert len(texts) > 1, "the text came in one piece, not streamed"
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    assert whole.content == "".join(str(t) for t in texts)
    assert whole.usage_metadata is not None
    assert 0 < whole.usage_metadata["output_tokens"] <= asks.CHAT_TOKENS


def test_forced_tool_call_lands_in_tool_calls(longer: ChatOpenAI) -> None:
    bound = longer.bind_tools([asks.GetWeather], tool_choice="GetWeather", strict=True)
    message = bound.invoke(asks.WEATHER)
    assert len(message.tool_calls) == 1 and message.invalid_tool_calls == []
    call = message.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"]
    assert asks.GetWeather.model_validate(call["args"]).city
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_structured_output_returns_the_model(longer: ChatOpenAI) -> None:
    # Its default method: response_format json_schema (the forced tool is shown above).
    city = longer.with_structured_output(asks.City, strict=True).invoke(asks.CITY)
    assert isinstance(city, asks.City)
    assert city.name and city.country
