"""API errors: ``ApiError``, which every handler raises, and how an API writes one.

Handlers raise ``ApiError``; the base app's middleware (``http/base_app.py``) turns it (and the
backend's own errors) into a response in the ``ErrorShape`` of the API whose path was asked,
or into a stream's final event once a stream has started. OpenAI's shape, the default, is
``{"error": {"message", "type", "param", "code", ...}}``.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from aiohttp import web

from mlxppd.runtime.backends.contract import (
    AdmissionClosed,
    AdmissionRejected,
    BackendUnavailable,
    RequestRefused,
    SequenceFailed,
)

INVALID_REQUEST = "invalid_request_error"

#: seconds a client should wait before retrying a 503 (KV frees as soon as a request ends)
ADMISSION_RETRY_AFTER_S = 1
UNAVAILABLE_RETRY_AFTER_S = 5


class ApiError(Exception):
    """An error the client caused or can act on; ``status`` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.extra = extra or {}
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        error.update(self.extra)
        return {"error": error}


# host:port, IPv4 and bracketed IPv6 addresses: how stages are reached is not a client's business.
_ADDRESS = re.compile(
    r"\[[0-9A-Fa-f:.%]+\](?::\d+)?"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?"
    r"|\b[A-Za-z0-9-]*[A-Za-z][A-Za-z0-9-]*(?:\.[A-Za-z0-9-]+)*:\d{2,5}\b"
)


def public_reason(text: str) -> str:
    """A backend's reason as a client may see it: the same sentence without addresses."""
    return _ADDRESS.sub("<address>", text)


def invalid(message: str, param: str | None, code: str | None = None) -> ApiError:
    """A 400 naming the request field at fault."""
    return ApiError(400, message, param=param, code=code)


def from_backend_error(exc: BaseException) -> ApiError:
    """The API error for a backend failure (admission, unavailable) or an unexpected one."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestRefused):
        return ApiError(400, str(exc), code="invalid_value")
    if isinstance(exc, SequenceFailed):
        return ApiError(500, public_reason(str(exc)), type="server_error", code="sequence_failed")
    if isinstance(exc, AdmissionRejected):
        d = exc.diagnostic
        never = d.never_fits  # retrying cannot help: a 400, not a 503 with Retry-After
        return ApiError(
            400 if never else 503,
            str(exc),
            type=INVALID_REQUEST if never else "server_overloaded",
            code="context_length_exceeded" if never else "kv_admission_rejected",
            extra={
                "stage": d.stage_index,
                **({"rank": d.rank} if d.rank is not None else {}),
                "reason": str(d.reason),
                "used_bytes": d.used_memory_bytes,
                "budget_bytes": d.budget_bytes,
                "available_bytes": d.available_bytes,
                "active_sequences": d.active_sequences,
                "required_bytes": d.required_bytes,
            },
            headers={} if never else {"Retry-After": str(ADMISSION_RETRY_AFTER_S)},
        )
    if isinstance(exc, AdmissionClosed):
        return ApiError(
            503,
            public_reason(str(exc)),
            type="service_unavailable",
            code="admission_closed",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, BackendUnavailable):
        return ApiError(
            503,
            public_reason(str(exc)) or "the model pipeline is not available",
            type="service_unavailable",
            code="backend_unavailable",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )
    # The exception text may carry internals; the log has it under the request id.
    return ApiError(500, "internal server error", type="server_error", code="internal_error")


def error_response(error: ApiError, request_id: str | None = None) -> web.Response:
    headers = dict(error.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    return web.json_response(error.body(), status=error.status, headers=headers)


class ErrorShape(Protocol):
    """How one API writes an error: as its response, and as a stream's last event."""

    def body(self, error: ApiError, request_id: str | None = None) -> dict[str, Any]: ...

    def response(self, error: ApiError, request_id: str | None = None) -> web.Response: ...


class OpenAIErrors:
    """OpenAI's ``{"error": {...}}``; the request id travels in ``X-Request-Id`` alone."""

    def body(self, error: ApiError, request_id: str | None = None) -> dict[str, Any]:
        return error.body()

    def response(self, error: ApiError, request_id: str | None = None) -> web.Response:
        return error_response(error, request_id)


OPENAI_ERRORS: ErrorShape = OpenAIErrors()


class OllamaErrors:
    """Ollama's ``{"error": "<message>"}``: one string, so the field at fault starts it."""

    def body(self, error: ApiError, request_id: str | None = None) -> dict[str, Any]:
        message, param = error.message, error.param
        if param and not message.startswith(f"{param}:"):
            message = f"{param}: {message}"
        return {"error": message}

    def response(self, error: ApiError, request_id: str | None = None) -> web.Response:
        headers = dict(error.headers)
        if request_id:
            headers["X-Request-Id"] = request_id
        return web.json_response(self.body(error), status=error.status, headers=headers)


OLLAMA_ERRORS: ErrorShape = OllamaErrors()
