"""The Anthropic Python SDK (``anthropic``) against the live 2-stage cluster's Messages API, as
its users call it: ``base_url`` is the coordinator (no ``/v1``) and ``api_key`` the server's key.

Shown: a message and its token count parse into the SDK's objects; ``messages.stream`` yields
text deltas that the SDK folds into the same final message; a forced tool (``tool_choice``
``tool``) comes back as a ``ToolUseBlock`` whose input validates as the tool's model, which is
another way to structured output; the SDK's own structured output (``messages.parse`` with an
``output_format`` model: ``output_config.format``, held to its schema by the grammar) parses
into that model; a wrong key is the SDK's ``AuthenticationError``.

The SDK's ``messages.create`` takes no ``temperature`` argument (2.16.0 dropped it); the server
still reads the field, so these tests send it in ``extra_body``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.clients import asks
from tests.clients.conftest import LiveCluster
from tests.clients.loopback import LoopbackGuard

if TYPE_CHECKING:
    from anthropic import Anthropic
    from anthropic.types import Message

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]

GREEDY = {"temperature": 0}
WEATHER_TOOL = {
    "name": asks.WEATHER_TOOL_NAME,
    "description": asks.WEATHER_DESCRIPTION,
    "input_schema": asks.WEATHER_SCHEMA,
}
CITY_TOOL = {
    "name": "record_city",
    "description": "Record a city and its country.",
    "input_schema": asks.City.model_json_schema(),
}


def _ask(cluster: LiveCluster, text: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": cluster.model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
        "extra_body": GREEDY,
    }


def _forced(client: Anthropic, ask: dict[str, Any], tool: dict[str, Any]) -> Message:
    return client.messages.create(
        **ask, tools=[tool], tool_choice={"type": "tool", "name": tool["name"]}
    )


def test_message_and_token_count_parse(
    anthropic_client: Anthropic, live_cluster: LiveCluster, loopback_only: LoopbackGuard
) -> None:
    from anthropic.types import TextBlock

    ask = _ask(live_cluster, asks.HELLO, asks.CHAT_TOKENS)
    message = anthropic_client.messages.create(**ask)
    assert message.type == "message" and message.role == "assistant"
    assert message.model == live_cluster.model and message.id.startswith("msg_")
    assert isinstance(message.content[0], TextBlock) and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= asks.CHAT_TOKENS
    counted = anthropic_client.messages.count_tokens(model=ask["model"], messages=ask["messages"])
    assert counted.input_tokens == message.usage.input_tokens
    assert loopback_only.reached(live_cluster.url)  # this SDK's httpx2 transport is watched too


def test_stream_folds_into_the_final_message(
    anthropic_client: Anthropic, live_cluster: LiveCluster
) -> None:
    with anthropic_client.messages.stream(
        **_ask(live_cluster, asks.HELLO, asks.CHAT_TOKENS)
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len([p for p in pieces if p]) > 1, "the text came in one piece, not streamed"
    assert final.content[0].type == "text" and final.content[0].text == "".join(pieces)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert 0 < final.usage.output_tokens <= asks.CHAT_TOKENS


def test_forced_tool_comes_back_as_a_tool_use_block(
    anthropic_client: Anthropic, live_cluster: LiveCluster
) -> None:
    from anthropic.types import ToolUseBlock

    ask = _ask(live_cluster, asks.WEATHER, asks.TOOL_TOKENS)
    message = _forced(anthropic_client, ask, WEATHER_TOOL)
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if isinstance(b, ToolUseBlock)]
    assert len(uses) == 1 and uses[0].name == asks.WEATHER_TOOL_NAME
    assert uses[0].id.startswith("toolu_")
    assert asks.GetWeather.model_validate(uses[0].input).city


def test_structured_output_through_a_forced_tool(
    anthropic_client: Anthropic, live_cluster: LiveCluster
) -> None:
    message = _forced(anthropic_client, _ask(live_cluster, asks.CITY, asks.JSON_TOKENS), CITY_TOOL)
    block = message.content[-1]
    assert block.type == "tool_use"
    city = asks.City.model_validate(block.input)
    assert city.name and city.country


def test_a_wrong_key_is_the_sdks_authentication_error(live_cluster: LiveCluster) -> None:
    import anthropic

    ask = _ask(live_cluster, asks.HELLO, asks.CHAT_TOKENS)
    with anthropic.Anthropic(base_url=live_cluster.url, api_key="nope", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            c.messages.count_tokens(model=ask["model"], messages=ask["messages"])
    assert caught.value.status_code == 401


def test_the_sdks_structured_output_parses(
    anthropic_client: Anthropic, live_cluster: LiveCluster
) -> None:

    ask = _ask(live_cluster, asks.CITY, asks.JSON_TOKENS)
    parsed = anthropic_client.messages.parse(**ask, output_format=asks.City)
    assert isinstance(parsed.parsed_output, asks.City)
