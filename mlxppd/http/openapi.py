"""The OpenAPI 3.1 document of the coordinator's HTTP API, built from its pydantic models.

The OpenAI API's request bodies are the models of ``requests.py``, its responses those of
``api_models.py``; the Anthropic Messages API's are in ``anthropic_models.py``.
``openapi_document()`` is deterministic, so the copy checked in as ``docs/openapi.json``
(``scripts/gen_openapi.py``) is compared to it by the tests, and ``add_openapi_route`` serves the
same document at ``GET /openapi.json``. The document holds no secret and is public: the api-key
middleware guards /v1/* and /metrics only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, get_args

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import (
    GenerateJsonSchema,
    JsonSchemaMode,
    JsonSchemaValue,
    models_json_schema,
)
from pydantic_core import core_schema

from mlxppd import __version__
from mlxppd.http import anthropic_models as claude
from mlxppd.http import api_models as out
from mlxppd.http.ollama_openapi import OLLAMA_MODELS, ollama_paths
from mlxppd.http.requests import ChatCompletionRequest, CompletionRequest
from mlxppd.http.responses_openapi import MODELS as RESPONSES_MODELS
from mlxppd.http.responses_openapi import responses_paths

__all__ = [
    "OPENAPI_PATH",
    "OPENAPI_VERSION",
    "add_openapi_route",
    "openapi_document",
    "openapi_text",
    "schema_ref",
]

OPENAPI_VERSION = "3.1.0"
OPENAPI_PATH = "/openapi.json"
REF_TEMPLATE = "#/components/schemas/{model}"
BEARER = "bearerAuth"
#: Anthropic's clients send the key as ``x-api-key``; the server takes either header anywhere
X_API_KEY = "apiKeyHeader"

#: every model the document holds, with the mode its schema is drawn in (requests are what the
#: server accepts; responses are what it sends)
_MODELS: tuple[tuple[type[BaseModel], JsonSchemaMode], ...] = (
    (ChatCompletionRequest, "validation"),
    (CompletionRequest, "validation"),
    *((model, "serialization") for model in out.RESPONSE_MODELS),
    (claude.MessagesRequest, "validation"),
    (claude.CountTokensRequest, "validation"),
    *((model, "serialization") for model in claude.RESPONSE_MODELS),
    *OLLAMA_MODELS,
    *RESPONSES_MODELS,
)

_ERRORS: dict[int, str] = {
    400: (
        "The request is invalid: not JSON, a field missing, mistyped or out of range (`param` "
        "names it, e.g. `messages[2].role`), an option this server does not support, a prompt "
        "(plus max_tokens) longer than the context or than a stage's whole KV budget, sampling "
        "parameters a stage refused, or a header that is not UTF-8."
    ),
    401: "The API key is missing or wrong (only when the server has one).",
    403: (
        "Only without an API key: the Host header, or the Origin, names another server "
        "(`host_not_allowed`, `origin_not_allowed`): a web page elsewhere or DNS rebinding."
    ),
    404: "The model named in the request is not the one this server serves (`model_not_found`).",
    408: "The request body did not arrive within the server's body timeout.",
    413: "The request body is larger than the server accepts.",
    415: (
        "Only without an API key: the body is not sent as `application/json` "
        "(`unsupported_media_type`)."
    ),
    429: (
        "Rate limited. Not sent by this server today (it answers overload with 503); kept in "
        "the contract for a rate limit, with the same body and Retry-After when known."
    ),
    500: (
        "A stage failed on this one sequence (`sequence_failed`; the pipeline carries on), or a "
        "bug (`internal_error`; the log has it under the X-Request-Id)."
    ),
    503: (
        "Not now: too many requests in flight (`too_many_requests`), no KV room on a stage "
        "(`kv_admission_rejected`, with the stage's accounting), the pipeline down or not warm "
        "(`backend_unavailable`), admission held (`admission_closed`) or too many connections "
        "(`too_many_connections`). Retry after Retry-After seconds."
    ),
}

_HEADERS: dict[str, dict[str, Any]] = {
    "X-Request-Id": {
        "description": "the request's id, as the server's log line names it",
        "schema": {"type": "string"},
    },
    "Retry-After": {
        "description": "seconds to wait before retrying",
        "schema": {"type": "integer", "minimum": 0},
    },
    "WWW-Authenticate": {
        "description": "how to authenticate: Bearer",
        "schema": {"type": "string"},
    },
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _types(schema: Mapping[str, Any]) -> set[str] | None:
    """The JSON types ``schema`` admits, or None when that is not plain to see ($ref, ...)."""
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return {_json_type(v) for v in values}
    if "type" in schema:
        kind = schema["type"]
        return {kind} if isinstance(kind, str) else set(kind)
    members = schema.get("anyOf") or schema.get("oneOf")
    if members:
        found: set[str] = set()
        for member in members:
            types = _types(member)
            if types is None:
                return None
            found |= types
        return found
    return None


class _Schemas(GenerateJsonSchema):
    """pydantic's schemas, less a default whose JSON type the schema refuses: that is the
    field's parsed form (``logit_bias`` defaults to ``()``, its pairs, while clients send an
    object), not a value a client could send, and OpenAPI validators reject it."""

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        json_schema = super().default_schema(schema)
        if "default" in json_schema:
            types = _types(json_schema)
            kind = _json_type(json_schema["default"])
            if kind == "integer" and types is not None and "number" in types:
                kind = "number"
            if types is not None and kind not in types:
                del json_schema["default"]
        return json_schema


def schema_ref(name: str) -> dict[str, str]:
    """``{"$ref": "#/components/schemas/<name>"}``."""
    return {"$ref": REF_TEMPLATE.format(model=name)}


def _header(name: str, required: bool) -> dict[str, Any]:
    return {**_HEADERS[name], "required": required}


def _json(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": dict(schema)}}


def _events(*payloads: str) -> dict[str, Any]:
    """One server-sent event: ``data`` is a JSON payload of one of ``payloads`` or ``[DONE]``."""
    json_payload = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [schema_ref(p) for p in payloads]},
    }
    return {
        "description": (
            "One server-sent event (`data: <json>`). The stream ends with `data: [DONE]`, or, "
            "when it fails after it started, with an ErrorResponse event and no [DONE]."
        ),
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                # if/then/else, not anyOf: "[DONE]" is never parsed as JSON
                "if": {"const": "[DONE]"},
                "then": {"const": "[DONE]"},
                "else": json_payload,
            }
        },
    }


def _error(status: int, description: str | None = None) -> dict[str, Any]:
    headers: dict[str, Any] = {}
    # The listener's own 503 (too many connections) is answered before the app: no request id.
    headers["X-Request-Id"] = _header("X-Request-Id", required=status != 503)
    if status in (429, 503):
        headers["Retry-After"] = _header("Retry-After", required=status == 503)
    if status == 401:
        headers["WWW-Authenticate"] = _header("WWW-Authenticate", required=True)
    return {
        "description": description or _ERRORS[status],
        "headers": headers,
        "content": _json(schema_ref("ErrorResponse")),
    }


def _ok(description: str, content: dict[str, Any]) -> dict[str, Any]:
    return {
        "description": description,
        "headers": {"X-Request-Id": _header("X-Request-Id", required=True)},
        "content": content,
    }


def _keyed(operation: dict[str, Any], *statuses: int) -> dict[str, Any]:
    """An operation under the api key: bearer security and the errors every /v1 path can give
    (a bad header, a wrong key, the in-flight cap, a bug) plus ``statuses``."""
    responses = operation.setdefault("responses", {})
    for status in sorted({400, 401, 403, 500, 503, *statuses}):
        responses[str(status)] = _error(status)
    operation["security"] = [{BEARER: []}]
    return operation


def _completion_operation(
    operation_id: str, summary: str, request: str, response: str, chunk: str
) -> dict[str, Any]:
    return _keyed(
        {
            "operationId": operation_id,
            "summary": summary,
            "requestBody": {"required": True, "content": _json(schema_ref(request))},
            "responses": {
                "200": _ok(
                    f"The completion: one JSON {response}, or with `stream: true` server-sent "
                    f"events, each a {chunk} (one choice each), then `data: [DONE]`.",
                    {
                        **_json(schema_ref(response)),
                        "text/event-stream": {"schema": _events(chunk, "ErrorResponse")},
                    },
                )
            },
        },
        404,
        408,
        413,
        415,
        429,
    )


def _api_paths() -> dict[str, Any]:
    """The completion and model routes."""
    return {
        "/v1/chat/completions": {
            "post": _completion_operation(
                "createChatCompletion",
                "Chat completion (OpenAI's chat.completion)",
                "ChatCompletionRequest",
                "ChatCompletion",
                "ChatCompletionChunk",
            )
        },
        "/v1/completions": {
            "post": _completion_operation(
                "createCompletion",
                "Text completion (OpenAI's legacy text_completion)",
                "CompletionRequest",
                "TextCompletion",
                "TextCompletionChunk",
            )
        },
        "/v1/models": {
            "get": _keyed(
                {
                    "operationId": "listModels",
                    "summary": "The base model, then each LoRA adapter a request may choose",
                    "responses": {
                        "200": _ok("The model list.", _json(schema_ref("ModelList"))),
                    },
                }
            )
        },
        "/v1/models/{model}": {
            "get": _keyed(
                {
                    "operationId": "retrieveModel",
                    "summary": "One model card",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "description": "the alias clients see, or the backend's model id",
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": _ok("The model card.", _json(schema_ref("ModelCard"))),
                    },
                },
                404,
            )
        },
    }


def _service_paths() -> dict[str, Any]:
    """Health, metrics and this document."""
    return {
        "/health": {
            "get": {
                "operationId": "getHealth",
                "summary": "Whether every stage is connected and warm",
                "description": (
                    "Needs no key. With no key set, or with the key, the body also has model, "
                    "detail and stages."
                ),
                "security": [{}, {BEARER: []}],
                "responses": {
                    "200": _ok("Ready.", _json(schema_ref("Health"))),
                    "400": _error(400, "A header that is not UTF-8."),
                    "500": _error(500),
                    "503": {
                        "description": (
                            "Not ready (a Health body), or too many connections (an ErrorResponse)."
                        ),
                        "headers": {"X-Request-Id": _header("X-Request-Id", required=False)},
                        "content": _json(
                            {"anyOf": [schema_ref("Health"), schema_ref("ErrorResponse")]}
                        ),
                    },
                },
            }
        },
        "/metrics": {
            "get": _keyed(
                {
                    "operationId": "getMetrics",
                    "summary": "Prometheus metrics (only when the server has metrics enabled)",
                    "responses": {
                        "200": _ok(
                            "Prometheus' text exposition format.",
                            {"text/plain": {"schema": {"type": "string"}}},
                        ),
                        "404": _error(404, "The server does not serve metrics on this port."),
                    },
                }
            )
        },
        OPENAPI_PATH: {
            "get": {
                "operationId": "getOpenApiDocument",
                "summary": "This document",
                "security": [],
                "responses": {
                    "200": _ok("The OpenAPI document.", _json({"type": "object"})),
                    "400": _error(400, "A header that is not UTF-8."),
                    "500": _error(500),
                    "503": _error(503, "Too many connections."),
                },
            }
        },
    }


# --- the Anthropic Messages API ---

#: its errors: the OpenAI API's statuses, but 503 is Anthropic's 529 "overloaded"
_ANTHROPIC_ERRORS: dict[int, str] = {
    400: _ERRORS[400],
    401: _ERRORS[401],
    403: _ERRORS[403],
    404: _ERRORS[404],
    408: _ERRORS[408],
    413: _ERRORS[413],
    415: _ERRORS[415],
    500: _ERRORS[500],
    claude.OVERLOADED_STATUS: (
        "Overloaded (Anthropic's status for what the OpenAI API answers with 503): too many "
        "requests in flight, no KV room on a stage, the pipeline down or not warm, or "
        "admission held. Retry after Retry-After seconds."
    ),
}


def _anthropic_error(status: int) -> dict[str, Any]:
    headers = {"X-Request-Id": _header("X-Request-Id", required=True)}
    if status == claude.OVERLOADED_STATUS:
        headers["Retry-After"] = _header("Retry-After", required=True)
    if status == 401:
        headers["WWW-Authenticate"] = _header("WWW-Authenticate", required=True)
    return {
        "description": _ANTHROPIC_ERRORS[status],
        "headers": headers,
        "content": _json(schema_ref("AnthropicError")),
    }


def _named_events() -> dict[str, Any]:
    """One server-sent event of a streamed message: ``event: <type>``, then its JSON data."""
    names = [get_args(m.model_fields["type"].annotation)[0] for m in claude.STREAM_EVENTS]
    payloads = [m.__name__ for m in claude.STREAM_EVENTS] + [claude.AnthropicError.__name__]
    return {
        "description": (
            "One server-sent event (`event: <type>` then `data: <json>`, the same type): "
            "message_start, content_block_start, ping, content_block_delta..., "
            "content_block_stop, then one start/delta/stop per tool_use block, message_delta, "
            "message_stop. A stream that fails after it started ends with an `error` event."
        ),
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"enum": [*names, "error"]},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [schema_ref(p) for p in payloads]},
            },
        },
    }


def _anthropic_operation(
    operation_id: str, summary: str, request: str, ok: dict[str, Any]
) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": ok}
    for status in sorted(_ANTHROPIC_ERRORS):
        responses[str(status)] = _anthropic_error(status)
    # The listener's own refusal comes before the API, in the OpenAI shape.
    responses["503"] = _error(503, "Too many connections (answered before the API).")
    return {
        "operationId": operation_id,
        "summary": summary,
        "requestBody": {"required": True, "content": _json(schema_ref(request))},
        "responses": responses,
        "security": [{BEARER: []}, {X_API_KEY: []}],
    }


def _anthropic_paths() -> dict[str, Any]:
    message = _ok(
        "The message: one JSON Message, or with `stream: true` Anthropic's named server-sent "
        "events.",
        {**_json(schema_ref("Message")), "text/event-stream": {"schema": _named_events()}},
    )
    return {
        claude.MESSAGES_PATH: {
            "post": _anthropic_operation(
                "createMessage",
                "A message (Anthropic's Messages API)",
                "MessagesRequest",
                message,
            )
        },
        claude.COUNT_TOKENS_PATH: {
            "post": _anthropic_operation(
                "countMessageTokens",
                "The prompt tokens a message would use",
                "CountTokensRequest",
                _ok("The count.", _json(schema_ref("MessageTokensCount"))),
            )
        },
    }


def _paths() -> dict[str, Any]:
    ollama = ollama_paths(schema_ref, BEARER)
    responses = responses_paths(_keyed, _ok)
    return {**_api_paths(), **responses, **_anthropic_paths(), **ollama, **_service_paths()}


def openapi_document(
    extra_paths: Mapping[str, Any] | None = None,
    extra_models: Iterable[tuple[type[BaseModel], JsonSchemaMode]] = (),
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the HTTP API (``app/api_app.py``'s routes).

    ``extra_paths``: more path items (e.g. ``{"/v1/messages": {"post": {...}}}``), merged into
    ``paths``; a path already there is an error. ``extra_models``: more pydantic models, with
    the mode of their schema ("validation" for a request, "serialization" for a response),
    whose schemas join ``components/schemas`` under their class names (``schema_ref(name)``).
    """
    models = [*_MODELS, *extra_models]
    _, top = models_json_schema(models, ref_template=REF_TEMPLATE, schema_generator=_Schemas)
    paths = _paths()
    for path, item in (extra_paths or {}).items():
        if path in paths:
            raise ValueError(f"{path} is already in the document")
        paths[path] = item
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "mlxpp OpenAI- and Anthropic-compatible API",
            "version": __version__,
            "description": (
                "Pipeline-parallel serving of MLX language models with OpenAI's chat and "
                "completions endpoints and Anthropic's Messages API. See docs/http-api.md."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": top.get("$defs", {}),
            "securitySchemes": {
                BEARER: {
                    "type": "http",
                    "scheme": "bearer",
                    "description": (
                        "The server's API key, when it has one; /v1/* and /metrics need it then."
                    ),
                }
            },
        },
    }


def openapi_text(document: Mapping[str, Any] | None = None) -> str:
    """The document as checked in at docs/openapi.json: sorted keys, indent 2, a final newline."""
    doc = openapi_document() if document is None else document
    return json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def add_openapi_route(app: web.Application, document: Mapping[str, Any] | None = None) -> None:
    """Serve ``document`` (default: ``openapi_document()``) at ``GET /openapi.json``."""
    body = openapi_text(document).encode()

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json", charset="utf-8")

    app.router.add_get(OPENAPI_PATH, handler)
