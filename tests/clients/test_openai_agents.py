"""OpenAI's Responses API on the live 2-stage cluster, with the ``openai-agents`` SDK on its
default model (``OpenAIResponsesModel``) and with the ``openai`` SDK's ``responses``.

Shown: an Agent with a function tool, the tool forced through ``ModelSettings.tool_choice``,
calls the tool with arguments the SDK parses into the function's parameters, and its run ends
with the tool's result; a plain Agent's streamed run ends with the greedy answer the Responses
API gives to the same input; a conversation continued with ``previous_response_id`` is
rendered with the earlier turn as its prefix, which the stages' prompt cache serves
(``usage.input_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from tests.clients import asks
from tests.clients.conftest import LiveCluster
from tests.clients.loopback import LoopbackGuard

if TYPE_CHECKING:
    from openai import OpenAI

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
ANSWER_TOKENS = 16


def _run_agent(live_cluster: LiveCluster, make_agent: Any, streamed: bool = False) -> Any:
    """Run the agent ``make_agent(model)`` builds on the cluster's Responses API."""
    from agents import OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    async def run() -> Any:
        async with AsyncOpenAI(
            base_url=live_cluster.v1, api_key=live_cluster.key, max_retries=0, timeout=120
        ) as openai_client:
            model = OpenAIResponsesModel(model=live_cluster.model, openai_client=openai_client)
            agent, prompt = make_agent(model)
            if not streamed:
                return await Runner.run(agent, prompt)
            result = Runner.run_streamed(agent, prompt)
            async for _ in result.stream_events():
                pass
            return result

    return asyncio.run(run())


def test_an_agent_calls_its_forced_function_tool(
    loopback_only: LoopbackGuard, live_cluster: LiveCluster
) -> None:
    from agents import Agent, ModelSettings, function_tool

    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"Sunny in {city}."

    def make_agent(model: Any) -> tuple[Any, str]:
        settings = ModelSettings(
            tool_choice=get_weather.name, temperature=0, max_tokens=asks.TOOL_TOKENS
        )
        agent = Agent(
            name="weather", instructions="Use the weather tool.", tools=[get_weather],
            model=model, model_settings=settings, tool_use_behavior="stop_on_first_tool",
        )  # fmt: skip
        return agent, asks.WEATHER

    result = _run_agent(live_cluster, make_agent)
    assert len(cities) == 1 and cities[0].strip()
    assert result.final_output == f"Sunny in {cities[0]}."


def test_an_agents_streamed_run_ends_with_the_greedy_answer(
    openai_client: OpenAI, live_cluster: LiveCluster
) -> None:
    from agents import Agent, ModelSettings

    def make_agent(model: Any) -> tuple[Any, str]:
        settings = ModelSettings(temperature=0, max_tokens=ANSWER_TOKENS)
        return Agent(name="plain", model=model, model_settings=settings), QUESTION

    result = _run_agent(live_cluster, make_agent, streamed=True)
    expected = openai_client.responses.create(
        model=live_cluster.model, input=QUESTION, temperature=0, max_output_tokens=ANSWER_TOKENS
    )
    assert result.final_output == expected.output_text
    assert expected.output_text


def test_a_continued_conversation_reads_its_prefix_from_the_prompt_cache(
    openai_client: OpenAI, live_cluster: LiveCluster
) -> None:
    def ask(text: str, **kw: Any) -> Any:
        return openai_client.responses.create(
            model=live_cluster.model, input=text, temperature=0,
            max_output_tokens=ANSWER_TOKENS, **kw,
        )  # fmt: skip

    first = ask("Describe a quiet forest at dawn.")
    second = ask("Make it shorter.", previous_response_id=first.id)
    before = first.usage.input_tokens_details.cached_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    # The second prompt starts with the first one and its answer, kept on every stage.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert cached > before and cached > first.usage.input_tokens // 2, (before, cached)
