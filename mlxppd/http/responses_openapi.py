"""The Responses API's part of the OpenAPI document (``http/openapi.py`` merges it): its paths
and the models of what its routes answer (the request is ``responses_models.ResponsesRequest``).

The models describe the shapes ``responses_reply.py`` and ``responses_stream.py`` build, as the
``openai`` SDK parses them. The paths are built with the document's own operation helpers,
handed in, so this module needs nothing from ``openapi.py`` (which imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import JsonSchemaMode

from mlxppd.http.responses_models import RESPONSES_PATH, ResponsesRequest

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Out(BaseModel):
    """What the server sends: exactly these fields (the document says so, tests hold it)."""

    model_config = ConfigDict(extra="forbid")


class OutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]


class OutputMessage(_Out):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(_Out):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as JSON text")
    status: ItemStatus


class InputTokensDetails(_Out):
    cached_tokens: int = Field(description="input tokens the stages took from a kept prefix")
    cache_write_tokens: int


class OutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Out):
    """A response (``object: response``), as created, streamed last and stored."""

    id: str = Field(description="resp_...")
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    usage: ResponseUsage | None = Field(description="null while the response is generated")
    incomplete_details: IncompleteDetails | None
    error: None
    instructions: str | None
    metadata: dict[str, str]
    temperature: float
    top_p: float
    max_output_tokens: int | None
    previous_response_id: str | None
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    store: bool
    truncation: Literal["auto", "disabled"]
    background: bool


class InputItemList(_Out):
    """The items a stored response was made from (newest first unless ``order=asc``)."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(_Out):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ResponseStreamEvent(_Out):
    """One event of a streamed response; which fields it has depends on its ``type``."""

    type: Literal[
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.completed",
        "response.incomplete",
        "error",
    ]
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item: OutputMessage | OutputFunctionCall | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    name: str | None = None
    logprobs: list[dict[str, Any]] | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None


MODELS: tuple[tuple[type[BaseModel], JsonSchemaMode], ...] = (
    (ResponsesRequest, "validation"),
    *(
        (model, "serialization")
        for model in (ResponseObject, InputItemList, DeletedResponse, ResponseStreamEvent)
    ),
)

Keyed = Callable[..., dict[str, Any]]
Ok = Callable[[str, dict[str, Any]], dict[str, Any]]


def _ref(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def _events() -> dict[str, Any]:
    names = list(get_args(ResponseStreamEvent.model_fields["type"].annotation))
    return {
        "description": (
            "One server-sent event (`event: <type>` then `data: <json>` of that type), numbered "
            "by sequence_number: response.created, response.in_progress, then per output item "
            "its added / delta / done events, then response.completed or response.incomplete. "
            "A stream that fails after it started ends with an `error` event."
        ),
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"enum": names},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"$ref": "#/components/schemas/ResponseStreamEvent"},
            },
        },
    }


def _id_parameter() -> dict[str, Any]:
    return {
        "name": "response_id",
        "in": "path",
        "required": True,
        "description": "a stored response's id (resp_...)",
        "schema": {"type": "string"},
    }


def responses_paths(keyed: Keyed, ok: Ok) -> dict[str, Any]:
    """The Responses API's path items; ``keyed(operation, *statuses)`` puts an operation under
    the api key with the errors every /v1 path gives, ``ok(description, content)`` is a 200."""
    created = ok(
        "The response: one JSON Response, or with `stream: true` typed server-sent events.",
        {**_ref("ResponseObject"), "text/event-stream": {"schema": _events()}},
    )
    one = f"{RESPONSES_PATH}/{{response_id}}"
    return {
        RESPONSES_PATH: {
            "post": keyed(
                {
                    "operationId": "createResponse",
                    "summary": "A model response (OpenAI's Responses API)",
                    "requestBody": {"required": True, "content": _ref("ResponsesRequest")},
                    "responses": {"200": created},
                },
                404,
                408,
                413,
                415,
                429,
            )  # fmt: skip
        },
        one: {
            "get": keyed(
                {
                    "operationId": "getResponse",
                    "summary": "A stored response",
                    "parameters": [_id_parameter()],
                    "responses": {"200": ok("The response.", _ref("ResponseObject"))},
                },
                404,
            ),
            "delete": keyed(
                {
                    "operationId": "deleteResponse",
                    "summary": "Forget a stored response",
                    "parameters": [_id_parameter()],
                    "responses": {"200": ok("Deleted.", _ref("DeletedResponse"))},
                },
                404,
            ),
        },
        f"{one}/input_items": {
            "get": keyed(
                {
                    "operationId": "listResponseInputItems",
                    "summary": "The input items of a stored response",
                    "parameters": [
                        _id_parameter(),
                        {
                            "name": "order",
                            "in": "query",
                            "required": False,
                            "schema": {"enum": ["asc", "desc"]},
                        },
                        {
                            "name": "limit",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "integer", "minimum": 1, "maximum": 100},
                        },
                        {
                            "name": "after",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string"},
                        },
                    ],  # fmt: skip
                    "responses": {"200": ok("The items.", _ref("InputItemList"))},
                },
                404,
            )
        },
    }
