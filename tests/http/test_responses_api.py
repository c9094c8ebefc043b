"""OpenAI's Responses API (``/v1/responses``) with the official ``openai`` client, against the
embedded model on two in-process stages (one server for the module, an api key, alias
"smollm").

Shown: a response's text is the chat API's greedy answer to the same conversation (a string
input, and items with instructions); its stream's typed events, in sequence, assemble to that
text; a token budget ends a response as incomplete; ``text.format`` json_schema holds the output
to the schema; a forced function tool comes back as a ``function_call`` whose arguments parse,
and the call with its output sent back is answered as the chat API answers the same tool turn,
streamed or not; a stored response can be fetched, its input items listed, continued with
``previous_response_id`` (the answer is the chat API's to the whole conversation) and deleted;
an unknown id is a 404 naming previous_response_id, and a field this server cannot honour a
400 naming it. (The prompt cache serving a continued conversation's prefix needs a cluster's
stages: ``tests/clients/test_openai_responses.py``.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from mlxppd.http.openai_api import create_app
from mlxppd.http.responses_api import add_responses_routes
from mlxppd.http.responses_openapi import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponseStreamEvent,
)
from tests.support.http import LiveServer

pytestmark = pytest.mark.slow

KEY = "responses-key"
MODEL = "smollm"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 8
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": WEATHER}  # fmt: skip
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def client(embedded_model_dir: Path) -> Iterator[openai.OpenAI]:
    server = LiveServer(embedded_model_dir, 2)
    try:
        app = create_app(server.backend, api_key=KEY, alias=MODEL)
        add_responses_routes(app)
        url = server.serve(app) + "/v1"
        with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120) as c:
            yield c
    finally:
        server.stop()


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS, **kw
    )


def _respond(client: openai.OpenAI, **kw: Any) -> Any:
    return client.responses.create(model=MODEL, temperature=0, max_output_tokens=MAX_TOKENS, **kw)


def test_a_response_says_what_a_chat_completion_says_and_streams_it(
    client: openai.OpenAI,
) -> None:
    chat = _chat(client, [{"role": "user", "content": QUESTION}])
    response = plain = _respond(client, input=QUESTION, metadata={"case": "plain"})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content
    (message,) = response.output
    assert message.type == "message" and message.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.metadata == {"case": "plain"}

    # Items: instructions are a system message first, developer is system, parts are joined.
    system = "Answer in one short sentence."
    items = [
        {"role": "developer", "content": "Be accurate."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "What is the capital "},
                     {"type": "input_text", "text": "of Italy?"}]},
    ]  # fmt: skip
    chat = _chat(
        client,
        [{"role": "system", "content": system}, {"role": "system", "content": "Be accurate."},
         {"role": "user", "content": "What is the capital of Italy?"}],
    )  # fmt: skip
    response = _respond(client, input=items, instructions=system)
    assert response.output_text == chat.choices[0].message.content

    events = list(_respond(client, input=QUESTION, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens


def test_a_token_budget_ends_a_response_as_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=2
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2
    events = list(
        client.responses.create(
            model=MODEL, input=QUESTION, temperature=0, max_output_tokens=2, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == response.output_text


def test_a_json_schema_format_holds_the_output_to_the_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input="Name a large city and its population as JSON.",
        temperature=0,
        max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}},
    )  # fmt: skip
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_a_forced_function_call_and_its_output_make_a_tool_turn(client: openai.OpenAI) -> None:
    ask = "What is the weather in Paris?"
    forced = {"type": "function", "name": "get_weather"}
    response = client.responses.create(
        model=MODEL, input=ask, tools=[TOOL], tool_choice=forced, temperature=0,
        max_output_tokens=32,
    )  # fmt: skip
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.status == "completed" and call.call_id
    arguments = json.loads(call.arguments)
    assert isinstance(arguments["city"], str)

    streamed = list(
        client.responses.create(
            model=MODEL, input=ask, tools=[TOOL], tool_choice=forced, temperature=0,
            max_output_tokens=32, stream=True,
        )
    )  # fmt: skip
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    assert streamed[-1].response.output[0].type == "function_call"

    # The call and its output sent back: the same tool turn as the chat API's.
    result = "Sunny, 21 degrees."
    items = [
        {"role": "user", "content": ask},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    answer = _respond(client, input=items, tools=[TOOL])
    chat = _chat(
        client,
        [{"role": "user", "content": ask},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": call.call_id, "type": "function",
                          "function": {"name": call.name, "arguments": call.arguments}}]},
         {"role": "tool", "tool_call_id": call.call_id, "content": result}],
        tools=[CHAT_TOOL],
    )  # fmt: skip
    assert answer.output_text == chat.choices[0].message.content
    assert answer.output_text


def test_stored_responses_are_fetched_listed_continued_and_deleted(
    client: openai.OpenAI,
) -> None:
    first = _respond(client, input=QUESTION)
    fetched = client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    (item,) = client.responses.input_items.list(first.id).data
    assert item.type == "message" and item.role == "user"
    assert item.content[0].text == QUESTION

    follow = "And of Spain?"
    second = _respond(client, input=follow, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    chat = _chat(
        client,
        [{"role": "user", "content": QUESTION},
         {"role": "assistant", "content": first.output_text},
         {"role": "user", "content": follow}],
    )  # fmt: skip
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens

    unstored = client.responses.create(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=1, store=False
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        _respond(client, input=follow, previous_response_id=first.id)
    assert missing.value.body["param"] == "previous_response_id"


def test_bodies_and_events_are_the_documents_models(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response
    body = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 4,
            "tools": [TOOL]}  # fmt: skip
    created = ResponseObject.model_validate(raw.create(**body).http_response.json())
    assert created.status == "incomplete" and created.usage is not None
    stored = raw.retrieve(created.id).http_response.json()
    assert ResponseObject.model_validate(stored) == created
    InputItemList.model_validate(raw.input_items.list(created.id).http_response.json())
    assert DeletedResponse.model_validate(raw.delete(created.id).http_response.json()).deleted

    names, events = [], []
    with client.responses.with_streaming_response.create(**body, stream=True) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
            elif line.startswith("data: "):
                events.append(ResponseStreamEvent.model_validate_json(line[6:]))
    assert names == [e.type for e in events] and names[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 3),
        ("tools", [{"type": "web_search"}]),
        ("background", True),
        ("conversation", "conv_123"),
    ],
)
def test_a_field_this_server_cannot_honour_is_a_400_naming_it(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input=QUESTION, extra_body={field: value})
    assert bad.value.body["param"].startswith(field)
