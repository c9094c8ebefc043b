"""The official ``openai`` Python client against the API (embedded model, 2 stages, api key)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.http import LiveServer

pytestmark = pytest.mark.slow

KEY = "test-key"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def base_url(embedded_model_dir: Path) -> Iterator[str]:
    server = LiveServer(embedded_model_dir, 2)
    try:
        yield server.start_app(api_key=KEY, alias="smollm") + "/v1"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)


def test_chat_completion_plain_and_streaming(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="smollm", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True
    )
    choice = answer.choices[0]
    assert choice.message.content == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    assert answer.usage.completion_tokens == 8
    assert all(t.logprob <= 0 for t in choice.logprobs.content)

    chunks = list(
        client.chat.completions.create(
            model="smollm",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.total_tokens == answer.usage.total_tokens


def test_completions_plain_and_streaming(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model="smollm", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(
            model="smollm",
            prompt="The capital of France is",
            max_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == answer.choices[0].text


def test_models_and_errors(client: openai.OpenAI, base_url: str) -> None:
    assert [m.id for m in client.models.list()] == ["smollm"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smollm", messages=MESSAGES, temperature=3)
    assert bad.value.body["param"] == "temperature"
    wrong = openai.OpenAI(base_url=base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
