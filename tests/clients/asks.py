"""What every client module asks the shared cluster: the same prompts, tools and output types,
each with a token budget the embedded SmolLM2-135M finishes in at temperature 0. The tool and
output schemas are closed (no property beyond those named), as strict mode writes them: the
server's grammar then holds the small model to exactly these keys."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

#: a plain chat turn, and the tokens it may use (it is cut by max_tokens: the point is the shape)
HELLO = "Say hello."
CHAT_TOKENS = 4
#: a question the forced tool answers; enough tokens for the call {"city": "..."} to close
WEATHER = "What is the weather in Paris?"
TOOL_TOKENS = 40
#: a structured-output request; enough tokens for {"name": "...", "country": "..."} to close
CITY = "Paris is in France. Give the city as JSON."
JSON_TOKENS = 40


class GetWeather(BaseModel):
    """The current weather in a city."""

    model_config = ConfigDict(extra="forbid")

    city: str


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    country: str


WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL_NAME = "get_weather"
WEATHER_DESCRIPTION = "The current weather in a city."


def openai_weather_tool() -> dict[str, Any]:
    """The weather tool in OpenAI's chat tool form (strict, closed schema)."""
    return {
        "type": "function",
        "function": {
            "name": WEATHER_TOOL_NAME,
            "description": WEATHER_DESCRIPTION,
            "parameters": WEATHER_SCHEMA,
            "strict": True,
        },
    }


def chat_ask(model: str, text: str, max_tokens: int) -> dict[str, Any]:
    """One greedy user turn, as OpenAI-style chat keyword arguments."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def forced_weather() -> dict[str, Any]:
    """OpenAI's ``tool_choice`` naming the weather tool."""
    return {"type": "function", "function": {"name": WEATHER_TOOL_NAME}}


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"
