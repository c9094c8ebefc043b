"""The OpenAI Python SDK (``openai``) against the live 2-stage cluster, as its users call it:
``base_url`` is the coordinator's ``/v1`` and ``api_key`` the server's key.

Shown: the model list names the alias; a chat completion and its stream parse into the SDK's
objects, the stream carrying the same greedy text; a forced tool call, plain or streamed
through the SDK's ``stream()`` helper, comes back as a call whose arguments the SDK parses into
the tool's pydantic model; a forced call cut by max_tokens is a partial call (never text), plain
and streamed, as OpenAI answers it; ``parse(response_format=Model)`` returns the model; a wrong
key is the SDK's ``AuthenticationError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.clients import asks
from tests.clients.conftest import LiveCluster
from tests.clients.loopback import LoopbackGuard

if TYPE_CHECKING:
    from openai import OpenAI

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]


def _weather_tool() -> Any:
    import openai

    return openai.pydantic_function_tool(
        asks.GetWeather, name=asks.WEATHER_TOOL_NAME, description=asks.WEATHER_DESCRIPTION
    )


def _forced_weather(cluster: LiveCluster, max_tokens: int, tool: Any) -> dict[str, Any]:
    return {
        **asks.chat_ask(cluster.model, asks.WEATHER, max_tokens),
        "tools": [tool],
        "tool_choice": asks.forced_weather(),
    }


def test_model_list_names_the_alias_over_loopback(
    openai_client: OpenAI, live_cluster: LiveCluster, loopback_only: LoopbackGuard
) -> None:
    assert [m.id for m in openai_client.models.list()] == [live_cluster.model]
    assert loopback_only.reached(live_cluster.url)  # the guard watches this SDK's transport


def test_chat_completion_parses(openai_client: OpenAI, live_cluster: LiveCluster) -> None:
    reply = openai_client.chat.completions.create(
        **asks.chat_ask(live_cluster.model, asks.HELLO, asks.CHAT_TOKENS)
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == live_cluster.model
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= asks.CHAT_TOKENS
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_stream_carries_the_same_greedy_text(
    openai_client: OpenAI, live_cluster: LiveCluster
) -> None:
    ask = asks.chat_ask(live_cluster.model, asks.HELLO, asks.CHAT_TOKENS)
    whole = openai_client.chat.completions.create(**ask).choices[0].message.content
    stream = openai_client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 1, "the text came in one piece, not streamed"
    assert "".join(deltas) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_forced_tool_call_parses_into_the_tool_model(
    openai_client: OpenAI, live_cluster: LiveCluster
) -> None:
    reply = openai_client.chat.completions.parse(
        **_forced_weather(live_cluster, asks.TOOL_TOKENS, _weather_tool())
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == asks.WEATHER_TOOL_NAME and call.id.startswith("call_")
    assert isinstance(call.function.parsed_arguments, asks.GetWeather)
    assert call.function.parsed_arguments.city


def test_streamed_tool_call_through_the_stream_helper(
    openai_client: OpenAI, live_cluster: LiveCluster
) -> None:
    with openai_client.chat.completions.stream(
        **_forced_weather(live_cluster, asks.TOOL_TOKENS, _weather_tool())
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert len(done) == 1 and isinstance(done[0].parsed_arguments, asks.GetWeather)
    calls = final.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.parsed_arguments == done[0].parsed_arguments
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_cut_forced_call_is_a_partial_call_plain_or_streamed(
    openai_client: OpenAI, live_cluster: LiveCluster
) -> None:
    # 4 tokens cut the call while its name is being written.
    ask = _forced_weather(live_cluster, 4, asks.openai_weather_tool())
    choice = openai_client.chat.completions.create(**ask).choices[0]
    # As OpenAI answers: the call so far in tool_calls, finish_reason "length", no content.
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name == asks.WEATHER_TOOL_NAME
    chunks = [c.choices[0] for c in openai_client.chat.completions.create(**ask, stream=True)]
    assert "".join(c.delta.content or "" for c in chunks) == ""
    streamed = [t for c in chunks for t in c.delta.tool_calls or ()]
    assert [t.function.name for t in streamed if t.function] == [asks.WEATHER_TOOL_NAME]
    assert chunks[-1].finish_reason == "length"


def test_structured_output_parses_into_the_model(
    openai_client: OpenAI, live_cluster: LiveCluster
) -> None:
    reply = openai_client.chat.completions.parse(
        **asks.chat_ask(live_cluster.model, asks.CITY, asks.JSON_TOKENS),
        response_format=asks.City,
    )
    message = reply.choices[0].message
    assert isinstance(message.parsed, asks.City)
    assert message.parsed.name and message.parsed.country
    assert reply.choices[0].finish_reason == "stop"


def test_a_wrong_key_is_the_sdks_authentication_error(live_cluster: LiveCluster) -> None:
    import openai

    with openai.OpenAI(base_url=live_cluster.v1, api_key="not-the-key", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as caught:
            c.models.list()
    assert caught.value.status_code == 401
