"""LiteLLM (``litellm``) against the live 2-stage cluster, through its ``openai/`` provider
(``api_base`` the coordinator's ``/v1``) and once through its ``anthropic/`` provider
(``api_base`` the coordinator itself, the Messages API).

Shown: ``completion`` returns a ``ModelResponse`` with usage; a streamed completion's chunks
rebuild, with ``stream_chunk_builder``, into a ``ModelResponse`` of the same text; a forced
``tool_choice`` comes back as ``tool_calls`` with JSON arguments of the tool's schema;
``response_format=Model`` (sent as json_schema) returns JSON that validates as the model; the
``anthropic/`` provider's reply is a ``ModelResponse`` too.

LiteLLM is imported in a fixture, after ``conftest.py`` set ``LITELLM_LOCAL_MODEL_COST_MAP`` and
``LITELLM_OFFLINE_MODE`` (its price map and tokenizers then come from the package, not the web),
and with no callbacks; 1.110.2 has no ``litellm.telemetry`` setting (it sends no telemetry).
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest

from tests.clients import asks
from tests.clients.conftest import LiveCluster
from tests.clients.loopback import LoopbackGuard

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("loopback_only"),
    # litellm's own use of pydantic, not this server's: noise in the suite's summary
    pytest.mark.filterwarnings("ignore:.*ReadOnly. qualifier:UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:litellm"),
]


@pytest.fixture(scope="module")
def litellm(loopback_only: LoopbackGuard) -> ModuleType:
    import litellm

    assert not (litellm.callbacks or litellm.success_callback or litellm.failure_callback)
    litellm.suppress_debug_info = True  # no "Provider List" banner for a model it cannot price
    return litellm


def _openai(cluster: LiveCluster, text: str, max_tokens: int) -> dict[str, Any]:
    return {
        **asks.chat_ask(f"openai/{cluster.model}", text, max_tokens),
        "api_base": cluster.v1,
        "api_key": cluster.key,
        "num_retries": 0,
    }


def test_completion_is_a_model_response(litellm: ModuleType, live_cluster: LiveCluster) -> None:
    reply = litellm.completion(**_openai(live_cluster, asks.HELLO, asks.CHAT_TOKENS))
    assert isinstance(reply, litellm.ModelResponse)
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= asks.CHAT_TOKENS


def test_stream_rebuilds_into_a_model_response(
    litellm: ModuleType, live_cluster: LiveCluster
) -> None:
    ask = _openai(live_cluster, asks.HELLO, asks.CHAT_TOKENS)
    chunks = list(litellm.completion(**ask, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta]
    texts = [d for d in deltas if d]
    assert len(texts) > 1, "the text came in one piece, not streamed"
    rebuilt = litellm.stream_chunk_builder(chunks, messages=ask["messages"])
    assert isinstance(rebuilt, litellm.ModelResponse)
    assert rebuilt.choices[0].message.content == "".join(texts)
    assert 0 < rebuilt.usage.completion_tokens <= asks.CHAT_TOKENS


def test_forced_tool_choice_returns_tool_calls(
    litellm: ModuleType, live_cluster: LiveCluster
) -> None:
    reply = litellm.completion(
        **_openai(live_cluster, asks.WEATHER, asks.TOOL_TOKENS),
        tools=[asks.openai_weather_tool()],
        tool_choice=asks.forced_weather(),
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1 and calls[0].id.startswith("call_")
    assert calls[0].function.name == asks.WEATHER_TOOL_NAME
    assert asks.GetWeather.model_validate(json.loads(calls[0].function.arguments)).city


def test_response_format_model_returns_its_json(
    litellm: ModuleType, live_cluster: LiveCluster
) -> None:
    reply = litellm.completion(
        **_openai(live_cluster, asks.CITY, asks.JSON_TOKENS), response_format=asks.City
    )
    city = asks.City.model_validate_json(reply.choices[0].message.content)
    assert city.name and city.country
    assert reply.choices[0].finish_reason == "stop"


def test_the_anthropic_provider_reaches_the_messages_api(
    litellm: ModuleType, live_cluster: LiveCluster
) -> None:
    reply = litellm.completion(
        **asks.chat_ask(f"anthropic/{live_cluster.model}", asks.HELLO, asks.CHAT_TOKENS),
        api_base=live_cluster.url,  # the Messages API: litellm adds /v1/messages
        api_key=live_cluster.key,
        num_retries=0,
    )
    assert isinstance(reply, litellm.ModelResponse)
    assert reply.choices[0].message.content
    assert 0 < reply.usage.completion_tokens <= asks.CHAT_TOKENS
