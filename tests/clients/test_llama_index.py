"""LlamaIndex's OpenAI-compatible LLM (``llama-index-llms-openai-like``'s ``OpenAILike``) against
the live 2-stage cluster: ``api_base`` is the coordinator's ``/v1``, ``api_key`` the server's
key, and the model is declared a chat model that calls functions.

Shown: ``chat`` returns a ``ChatResponse`` over the raw completion; ``stream_chat`` yields deltas
whose last response holds the whole text; ``chat_with_tools(..., tool_required=True)`` comes
back as a ``ToolSelection`` with the arguments parsed; ``structured_predict(Model, ...)``, which
forces a tool of the model's schema, returns the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.clients import asks
from tests.clients.conftest import LiveCluster
from tests.clients.loopback import LoopbackGuard

if TYPE_CHECKING:
    from llama_index.llms.openai_like import OpenAILike

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]


@pytest.fixture(scope="module")
def llm(loopback_only: LoopbackGuard, live_cluster: LiveCluster) -> OpenAILike:
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(
        model=live_cluster.model,
        api_base=live_cluster.v1,
        api_key=live_cluster.key,
        is_chat_model=True,
        is_function_calling_model=True,
        context_window=2048,
        temperature=0,
        max_tokens=asks.CHAT_TOKENS,
        max_retries=0,
        timeout=120,
    )


@pytest.fixture(scope="module")
def longer(llm: OpenAILike) -> OpenAILike:
    """Room for a tool call's or an object's JSON to close."""
    return llm.model_copy(update={"max_tokens": asks.JSON_TOKENS})


def _user(text: str) -> list[object]:
    from llama_index.core.llms import ChatMessage

    return [ChatMessage(role="user", content=text)]


def test_chat_returns_a_chat_response(llm: OpenAILike, live_cluster: LiveCluster) -> None:
    response = llm.chat(_user(asks.HELLO))  # type: ignore[arg-type]
    assert response.message.role == "assistant"
    assert response.message.content
    assert response.raw is not None and response.raw.model == live_cluster.model
    assert 0 < response.additional_kwargs["completion_tokens"] <= asks.CHAT_TOKENS


def test_stream_chat_deltas_build_the_text(llm: OpenAILike) -> None:
    responses = list(llm.stream_chat(_user(asks.HELLO)))  # type: ignore[arg-type]
    deltas = [r.delta for r in responses if r.delta]
    assert len(deltas) > 1, "the text came in one piece, not streamed"
    assert responses[-1].message.content == "".join(deltas)


def test_required_tool_comes_back_as_a_tool_selection(longer: OpenAILike) -> None:
    from llama_index.core.tools import FunctionTool

    tool = FunctionTool.from_defaults(fn=asks.get_weather)
    response = longer.chat_with_tools([tool], user_msg=asks.WEATHER, tool_required=True)
    calls = longer.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    assert len(calls) == 1 and calls[0].tool_name == asks.WEATHER_TOOL_NAME and calls[0].tool_id
    assert asks.GetWeather.model_validate(calls[0].tool_kwargs).city
    assert tool(**calls[0].tool_kwargs).content.startswith("sunny in ")


def test_structured_predict_returns_the_model(longer: OpenAILike) -> None:
    from llama_index.core.prompts import PromptTemplate

    city = longer.structured_predict(asks.City, PromptTemplate(asks.CITY))
    assert isinstance(city, asks.City)
    assert city.name and city.country
