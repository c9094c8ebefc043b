"""The Ollama API's part of the OpenAPI document (``openapi.py`` merges it): its request
models (``ollama_models.py``) and its paths, each error Ollama's ``{"error": "..."}``.

The replies are described inline: they are Ollama's objects (``ollama_stream.py``), whose
fields Ollama's clients read by name. ``ollama_paths`` takes ``openapi.py``'s ``schema_ref``
and security scheme, which cannot be imported here (``openapi.py`` imports this module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from mlxppd.http.ollama_models import OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest

OLLAMA_MODELS: tuple[tuple[type[BaseModel], JsonSchemaMode], ...] = (
    (OllamaChatRequest, "validation"),
    (OllamaGenerateRequest, "validation"),
    (OllamaShowRequest, "validation"),
)

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string", "description": "what failed, and the fix"}},
}
_ERRORS = {
    400: "The request is invalid (the message starts with the field), or what it asks of the "
    "model is not done here (pull, push, create, copy, delete: the message names "
    "`mlxppctl prepare`).",
    401: "The API key is missing or wrong (only when the server has one).",
    404: "The model is not the one served, or embeddings (not served).",
    413: "The request body is larger than the server accepts.",
    500: "A stage failed on this sequence, or a bug (the log has it under X-Request-Id).",
    503: "Not now: too many requests, no KV room, the pipeline down. Retry after Retry-After.",
}
_DETAILS = {
    "type": "object",
    "properties": {
        k: {"type": "string"}
        for k in ("parent_model", "format", "family", "parameter_size", "quantization_level")
    },
}
_CARD = {
    "type": "object",
    "required": ["name", "model", "modified_at", "size", "digest", "details"],
    "properties": {
        "name": {"type": "string", "description": "the alias, tagged :latest"},
        "model": {"type": "string"},
        "modified_at": {"type": "string", "format": "date-time"},
        "size": {"type": "integer", "description": "bytes of the weights"},
        "digest": {"type": "string", "description": "sha256 of config.json and the weights' sizes"},
        "details": _DETAILS,
        "expires_at": {"type": "string", "format": "date-time", "description": "/api/ps"},
        "size_vram": {"type": "integer", "description": "/api/ps"},
        "context_length": {"type": "integer", "description": "/api/ps"},
    },
}
_COUNTS = {
    k: {"type": "integer", "description": "nanoseconds" if k.endswith("duration") else "tokens"}
    for k in (
        "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
        "eval_count", "eval_duration",
    )
}  # fmt: skip


def _reply(text: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["model", "created_at", "done"],
        "properties": {
            "model": {"type": "string"},
            "created_at": {"type": "string", "format": "date-time"},
            **text,
            "done": {"type": "boolean"},
            "done_reason": {"enum": ["stop", "length", "load"]},
            **_COUNTS,
        },
    }


_MESSAGE = {
    "message": {
        "type": "object",
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": "string"},
            "tool_calls": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "function": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string"},
                                "arguments": {"type": "object"},
                            },
                        }
                    },
                },
            },
        },
    }
}


def ollama_paths(schema_ref: Callable[[str], dict[str, str]], bearer: str) -> dict[str, Any]:
    """The /api paths, their request bodies as ``schema_ref``s, under ``bearer``."""

    def operation(
        op_id: str, summary: str, ok: dict[str, Any] | None, request: str | None = None,
        stream: bool = False, errors: tuple[int, ...] = (400, 401, 404, 413, 500, 503),
    ) -> dict[str, Any]:  # fmt: skip
        responses: dict[str, Any] = {}
        if ok is not None:
            content: dict[str, Any] = {"application/json": {"schema": ok}}
            if stream:
                content["application/x-ndjson"] = {"schema": ok}
            text = "One JSON object, or with `stream` (the default) one a line, the last done."
            responses["200"] = {"description": text if stream else "OK", "content": content}
        for status in errors:
            body = {"application/json": {"schema": _ERROR}}
            responses[str(status)] = {"description": _ERRORS[status], "content": body}
        out: dict[str, Any] = {
            "operationId": op_id, "summary": summary, "responses": responses,
            "security": [{bearer: []}],
        }  # fmt: skip
        if request is not None:
            asked = {"application/json": {"schema": schema_ref(request)}}
            out["requestBody"] = {"required": True, "content": asked}
        return out

    listing = {"type": "object", "properties": {"models": {"type": "array", "items": _CARD}}}
    version = {"type": "object", "properties": {"version": {"type": "string"}}}
    show = {"type": "object", "required": ["model_info"], "properties": {
        "template": {"type": "string"}, "details": _DETAILS, "model_info": {"type": "object"},
        "capabilities": {"type": "array", "items": {"type": "string"}},
    }}  # fmt: skip
    refused = (400, 401)
    paths: dict[str, Any] = {
        "/api/version": {"get": operation("ollamaVersion", "The Ollama API version", version,
                                          errors=(401,))},
        "/api/tags": {"get": operation("ollamaTags", "The served model", listing, errors=(401,))},
        "/api/ps": {"get": operation("ollamaPs", "The running model", listing, errors=(401,))},
        "/api/show": {"post": operation("ollamaShow", "The model's details", show,
                                        "OllamaShowRequest")},
        "/api/chat": {"post": operation("ollamaChat", "A chat reply",
                                        _reply(_MESSAGE), "OllamaChatRequest", stream=True)},
        "/api/generate": {"post": operation("ollamaGenerate", "A completion",
                                            _reply({"response": {"type": "string"}}),
                                            "OllamaGenerateRequest", stream=True)},
    }  # fmt: skip
    for name in ("pull", "push", "create", "copy"):
        paths[f"/api/{name}"] = {
            "post": operation(f"ollama{name.title()}", f"Refused: {name}", None, errors=refused)
        }
    paths["/api/delete"] = {"delete": operation("ollamaDelete", "Refused", None, errors=refused)}
    for name in ("embed", "embeddings"):
        paths[f"/api/{name}"] = {
            "post": operation(f"ollama{name.title()}", "Not served", None, errors=(401, 404))
        }
    return paths
