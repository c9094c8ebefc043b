"""Pydantic AI (``pydantic-ai-slim[openai]``) against the live 2-stage cluster: an
``OpenAIChatModel`` over an ``OpenAIProvider`` whose ``base_url`` is the coordinator's ``/v1``.

Shown: an agent's text run returns its output and usage; ``run_stream`` streams text deltas
that add up to the run's output; a direct model request with ``tool_choice`` naming a tool comes
back as a ``ToolCallPart`` with its arguments parsed; ``output_type=Model`` (its default: an
output tool, forced) and ``NativeOutput(Model)`` (``response_format`` json_schema) return the
model. Logfire is not installed (only its no-op API), so no instrumentation leaves the machine.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from tests.clients import asks
from tests.clients.conftest import LiveCluster
from tests.clients.loopback import LoopbackGuard

if TYPE_CHECKING:
    from pydantic_ai.models.openai import OpenAIChatModel

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]


@pytest.fixture(scope="module")
def model(loopback_only: LoopbackGuard, live_cluster: LiveCluster) -> OpenAIChatModel:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=live_cluster.v1, api_key=live_cluster.key)
    return OpenAIChatModel(live_cluster.model, provider=provider)


def _settings(max_tokens: int, **more: Any) -> Any:
    from pydantic_ai.settings import ModelSettings

    return ModelSettings(temperature=0, max_tokens=max_tokens, **more)  # type: ignore[typeddict-item]


def test_agent_text_run(model: OpenAIChatModel) -> None:
    from pydantic_ai import Agent

    result = Agent(model, model_settings=_settings(asks.CHAT_TOKENS)).run_sync(asks.HELLO)
    assert isinstance(result.output, str) and result.output
    assert result.usage.requests == 1
    assert 0 < result.usage.output_tokens <= asks.CHAT_TOKENS


def test_run_stream_deltas_add_up_to_the_output(model: OpenAIChatModel) -> None:
    from pydantic_ai import Agent

    agent = Agent(model, model_settings=_settings(asks.CHAT_TOKENS))

    async def run() -> tuple[list[str], str]:
        async with agent.run_stream(asks.HELLO) as streamed:
            deltas = [d async for d in streamed.stream_text(delta=True, debounce_by=None)]
            return deltas, await streamed.get_output()

    deltas, output = asyncio.run(run())
    assert len([d for d in deltas if d]) > 1, "the text came in one piece, not streamed"
    assert "".join(deltas) == output


def test_named_tool_choice_returns_a_tool_call_part(model: OpenAIChatModel) -> None:
    from pydantic_ai.direct import model_request_sync
    from pydantic_ai.messages import ModelRequest, ToolCallPart
    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.tools import ToolDefinition

    tool = ToolDefinition(
        name=asks.WEATHER_TOOL_NAME,
        description=asks.WEATHER_DESCRIPTION,
        parameters_json_schema=asks.WEATHER_SCHEMA,
        strict=True,
    )
    response = model_request_sync(
        model,
        [ModelRequest.user_text_prompt(asks.WEATHER)],
        model_settings=_settings(asks.TOOL_TOKENS, tool_choice=[asks.WEATHER_TOOL_NAME]),
        model_request_parameters=ModelRequestParameters(
            function_tools=[tool], allow_text_output=False
        ),
    )
    calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
    assert len(calls) == 1 and calls[0].tool_name == asks.WEATHER_TOOL_NAME
    assert asks.GetWeather.model_validate(calls[0].args_as_dict()).city
    assert response.finish_reason == "tool_call"


@pytest.mark.parametrize("native", [False, True], ids=["tool-output", "native-output"])
def test_structured_output_returns_the_model(model: OpenAIChatModel, native: bool) -> None:
    from pydantic_ai import Agent, NativeOutput

    output: Any = NativeOutput(asks.City) if native else asks.City
    agent = Agent(model, output_type=output, model_settings=_settings(asks.JSON_TOKENS))
    result = agent.run_sync(asks.CITY)
    assert isinstance(result.output, asks.City)
    assert result.output.name and result.output.country
    assert result.usage.requests == 1
