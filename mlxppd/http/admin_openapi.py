"""The OpenAPI 3.1 document of the admin API, built from its pydantic models.

The status document and the repartition events are the models of
``mlxppd/core/status_document.py``, the request bodies and small replies those of
``admin_models.py``, the errors the OpenAI API's ``ErrorResponse`` (``api_models.py``).
``admin_openapi_document()`` is deterministic: ``scripts/gen_openapi.py`` checks it in as
``docs/admin-openapi.json``, the tests compare the two, and ``admin_api.py`` serves it at
``GET /admin/v1/openapi.json``, unsigned (it says how to ask, not what any cluster holds).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from mlxppd import __version__
from mlxppd.core.status_document import RepartitionEvents, StatusDocument
from mlxppd.http import admin_models as m
from mlxppd.http.api_models import ErrorResponse

__all__ = ["admin_openapi_document", "admin_openapi_text"]

OPENAPI_VERSION = "3.1.0"
REF_TEMPLATE = "#/components/schemas/{model}"
HMAC = "mlxppHmac"
ED25519 = "mlxppEd25519"

#: every model the document holds, with the mode its schema is drawn in (requests are what the
#: server accepts; replies what it sends)
_MODELS: tuple[tuple[type[BaseModel], JsonSchemaMode], ...] = (
    (StatusDocument, "serialization"),
    (RepartitionEvents, "serialization"),
    (m.Challenge, "serialization"),
    (m.AdmissionReply, "serialization"),
    (m.Refusal, "serialization"),
    (m.RepartitionAccepted, "serialization"),
    (m.PrepareAccepted, "serialization"),
    (m.AdapterLoaded, "serialization"),
    (m.AdapterUnloaded, "serialization"),
    (ErrorResponse, "serialization"),
    (m.RepartitionRequest, "validation"),
    (m.PrepareRequest, "validation"),
    (m.AdapterLoadRequest, "validation"),
    (m.AdapterUnloadRequest, "validation"),
)

_SIGNED_ERRORS = {
    "401": (
        "The signature is missing, malformed, stale, replayed, made with another key or for "
        "another cluster or Host (`code` says which); WWW-Authenticate names the cluster."
    ),
    "408": "The request body did not arrive within the server's body timeout.",
    "413": "The request body is over 64 KiB.",
    "500": "The coordinator failed; its log has the details.",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=name)}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


def _answer(description: str, model: str) -> dict[str, Any]:
    return {"description": description, "content": _json(model)}


def _signed(
    operation_id: str,
    summary: str,
    responses: Mapping[str, dict[str, Any]],
    body: str | None = None,
) -> dict[str, Any]:
    """An operation behind the signature: its own answers, then the errors of every one."""
    answers = dict(responses)
    for status, description in _SIGNED_ERRORS.items():
        answers[status] = _answer(description, "ErrorResponse")
    answers["401"]["headers"] = {
        "WWW-Authenticate": {
            "description": 'MLXPP-ED25519 cluster="<name>" (or MLXPP-HMAC, legacy mode): the '
            "scheme and the cluster to sign for",
            "required": True,
            "schema": {"type": "string"},
        }
    }
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        # Either: an operator's signature, or (legacy, no [operators]) the secret's HMAC.
        "security": [{ED25519: []}, {HMAC: []}],
        "responses": answers,
    }
    if body is not None:
        # Every field is optional, and an empty body means {}.
        operation["requestBody"] = {"required": False, "content": _json(body)}
    return operation


def _invalid(code: str) -> dict[str, Any]:
    return _answer(
        f"The body is not valid (`{code}`; the message names the field).", "ErrorResponse"
    )


def _action(
    operation_id: str, summary: str, ok: str, ok_model: str, body: str, code: str
) -> dict[str, Any]:
    """A POST that starts something: accepted (200 or 202), refused (409) or a bad body."""
    return _signed(
        operation_id,
        summary,
        {
            ok: _answer("Accepted.", ok_model),
            "400": _invalid(code),
            "409": _answer("Refused: `reason` and `message` say why.", "Refusal"),
        },
        body,
    )


#: the POSTs that start something: path -> (operationId, summary, success status, its reply,
#: the body, the 400's code)
_ACTIONS: dict[str, tuple[str, str, str, str, str, str]] = {
    m.REPARTITION_PATH: (
        "repartition", "Move layers between stages on the live cluster (elastic)",
        "202", "RepartitionAccepted", "RepartitionRequest", "invalid_repartition_request",
    ),
    m.PREPARE_PATH: (
        "prepare", "Ship stage nodes the model tensors their layers need",
        "202", "PrepareAccepted", "PrepareRequest", "invalid_prepare_request",
    ),
    m.ADAPTERS_PATH: (
        "loadAdapter", "Hold a per-request LoRA adapter on every stage",
        "200", "AdapterLoaded", "AdapterLoadRequest", "invalid_adapter_request",
    ),
    m.ADAPTERS_UNLOAD_PATH: (
        "unloadAdapter", "Drain one adapter's requests, then drop it on every stage",
        "200", "AdapterUnloaded", "AdapterUnloadRequest", "invalid_adapter_request",
    ),
}  # fmt: skip


def _signed_paths() -> dict[str, Any]:
    admission = {"200": _answer("Admission now.", "AdmissionReply")}
    events = _signed(
        "getRepartitionEvents",
        "The elastic state and the repartition events numbered above `after`",
        {
            "200": _answer("The events.", "RepartitionEvents"),
            "400": _answer("`after` is not an integer (`invalid_after`).", "ErrorResponse"),
        },
    )
    events["parameters"] = [
        {
            "name": "after",
            "in": "query",
            "required": False,
            "description": "only events numbered above this (default -1: all kept)",
            "schema": {"type": "integer", "default": -1},
        }
    ]
    status = _signed(
        "getStatus",
        "The cluster's status: coordinator, stages, standbys and the health badge",
        {"200": _answer("The status document.", "StatusDocument")},
    )
    return {
        m.STATUS_PATH: {"get": status},
        m.DRAIN_PATH: {
            "post": _signed("drain", "Stop admitting requests; running ones finish", admission)
        },
        m.RESUME_PATH: {"post": _signed("resume", "Admit requests again", admission)},
        m.EVENTS_PATH: {"get": events},
        **{path: {"post": _action(*action)} for path, action in _ACTIONS.items()},
    }


def _unsigned_paths() -> dict[str, Any]:
    document = {"application/json": {"schema": {"type": "object"}}}
    return {
        m.CHALLENGE_PATH: {
            "get": {
                "operationId": "getChallenge",
                "summary": "The cluster name to sign for (unsigned)",
                "security": [],
                "responses": {"200": _answer("The scheme and the cluster.", "Challenge")},
            }
        },
        m.ADMIN_OPENAPI_PATH: {
            "get": {
                "operationId": "getAdminOpenApiDocument",
                "summary": "This document (unsigned)",
                "security": [],
                "responses": {"200": {"description": "The document.", "content": document}},
            }
        },
    }


def admin_openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the admin API (``admin_api.py``'s routes)."""
    _, top = models_json_schema(_MODELS, ref_template=REF_TEMPLATE)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "mlxpp admin API",
            "version": __version__,
            "description": (
                "The coordinator's signed admin API: the cluster's status, drain and resume, "
                "elastic repartitioning, prepare and adapters. See docs/admin-api.md."
            ),
        },
        "paths": {**_signed_paths(), **_unsigned_paths()},
        "components": {
            "schemas": top.get("$defs", {}),
            "securitySchemes": {
                ED25519: {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Authorization",
                    "description": (
                        "MLXPP-ED25519 name=<operator>,ts=<unix seconds>,nonce=<32 hex>,"
                        "sig=<base64>: an Ed25519 signature of the request by a key listed "
                        "under [operators] in the cluster TOML, bound to the cluster's name and "
                        "the Host (docs/admin-api.md, Request signing)."
                    ),
                },
                HMAC: {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Authorization",
                    "description": (
                        "MLXPP-HMAC ts=<unix seconds>,nonce=<32 hex>,mac=<64 hex> (legacy mode, "
                        "only while the cluster TOML lists no [operators]): an HMAC of "
                        "the request with a key derived from the cluster secret, bound to the "
                        "cluster's name and the Host (docs/admin-api.md, Request signing)."
                    ),
                },
            },
        },
    }


def admin_openapi_text(document: Mapping[str, Any] | None = None) -> str:
    """The document as checked in at docs/admin-openapi.json: sorted keys, indent 2, a final
    newline."""
    doc = admin_openapi_document() if document is None else document
    return json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
