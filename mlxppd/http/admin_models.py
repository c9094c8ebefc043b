"""The admin API's routes, request bodies and small replies, as the OpenAPI document shows them.

The status document and the repartition events are ``mlxppd/core/status_document.py``'s (the
runtime builds them); the bodies here are parsed by ``admin_api.py``, and the replies describe
what the runtime answers to drain, resume, repartition, prepare and the adapter routes
(``tests/http/test_admin_api.py`` checks a live server's replies against them).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxppd.core.strict import StrictModel

__all__ = [
    "ADAPTERS_PATH",
    "ADAPTERS_UNLOAD_PATH",
    "ADMIN_OPENAPI_PATH",
    "ADMIN_PREFIX",
    "CHALLENGE_PATH",
    "DRAIN_PATH",
    "EVENTS_PATH",
    "PREPARE_PATH",
    "REPARTITION_PATH",
    "RESUME_PATH",
    "STATUS_PATH",
    "AdapterLoadRequest",
    "AdapterLoaded",
    "AdapterStageLoad",
    "AdapterUnloadRequest",
    "AdapterUnloaded",
    "AdmissionReply",
    "Challenge",
    "PrepareAccepted",
    "PrepareRequest",
    "Refusal",
    "RepartitionAccepted",
    "RepartitionRequest",
]

ADMIN_PREFIX = "/admin/"
STATUS_PATH = "/admin/v1/status"
DRAIN_PATH = "/admin/v1/drain"
RESUME_PATH = "/admin/v1/resume"
REPARTITION_PATH = "/admin/v1/repartition"
EVENTS_PATH = "/admin/v1/repartition/events"
PREPARE_PATH = "/admin/v1/prepare"
ADAPTERS_PATH = "/admin/v1/adapters"
ADAPTERS_UNLOAD_PATH = "/admin/v1/adapters/unload"
#: unsigned: which cluster name to sign for (no secret, no state)
CHALLENGE_PATH = "/admin/v1/challenge"
#: unsigned: the OpenAPI document of these routes (their shape only)
ADMIN_OPENAPI_PATH = "/admin/v1/openapi.json"


# --- request bodies ---


class AdapterLoadRequest(StrictModel):
    """The body of POST /admin/v1/adapters."""

    name: str = Field(min_length=1, max_length=64, description="what requests send as model")
    path: str = Field(
        min_length=1, max_length=4096, description="the adapter directory, on every stage host"
    )


class AdapterUnloadRequest(StrictModel):
    """The body of POST /admin/v1/adapters/unload."""

    name: str = Field(min_length=1, max_length=64, description="the adapter's name")
    drain_timeout_s: float = Field(
        60.0, gt=0, le=86400, description="how long its running requests may take (seconds)"
    )


class RepartitionRequest(StrictModel):
    """The body of POST /admin/v1/repartition."""

    stage_memory: list[int | None] | None = Field(
        None, max_length=1024, description="memory budget per stage in bytes (null: unlimited)"
    )
    pp_layers: str | None = Field(
        None, min_length=1, max_length=8192, description='inclusive ranges, e.g. "0-9,10-29"'
    )


class PrepareRequest(StrictModel):
    """The body of POST /admin/v1/prepare."""

    max_rate_bytes_s: float | None = Field(
        None, gt=0, le=1e12, description="send at most this many bytes per second to each node"
    )
    nodes: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        None, max_length=1024, description="node ids to prepare (null: every stage node)"
    )


# --- replies ---


class Reply(BaseModel):
    """A reply of the admin API: frozen, unknown keys refused, docstrings as descriptions."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Challenge(Reply):
    """GET /admin/v1/challenge: the cluster name a request is signed for."""

    scheme: Literal["MLXPP-ED25519", "MLXPP-HMAC"]
    """the Authorization scheme: MLXPP-ED25519 (an operator key) when the cluster lists
    [operators], else MLXPP-HMAC (legacy: the key derived from the cluster secret)"""
    cluster: str
    """the cluster's [cluster] name, the sixth line of the string to sign"""


class AdmissionReply(Reply):
    """POST /admin/v1/drain and /admin/v1/resume: admission now."""

    admission: Literal["open", "draining"]
    """open, or draining (another hold, such as a reload, keeps it closed after a resume)"""
    in_flight: int = Field(ge=0)
    """requests still generating"""


class Refusal(Reply):
    """A 409: the action was not taken, and why."""

    accepted: Literal[False]
    """always false"""
    reason: str
    """a word for programs, e.g. busy, disabled, running, unsupported, refused"""
    message: str
    """the sentence for people"""


class RepartitionAccepted(Reply):
    """A 202 from POST /admin/v1/repartition: the drain has begun."""

    accepted: Literal[True]
    """always true"""
    state: str
    """the elastic state now (draining)"""
    seq: int = Field(ge=0)
    """the number of its first event; follow it with /admin/v1/repartition/events"""


class PrepareAccepted(Reply):
    """A 202 from POST /admin/v1/prepare: the prepare runs; its progress is in the status."""

    accepted: Literal[True]
    """always true"""
    nodes: list[str]
    """the nodes being prepared"""


class AdapterStageLoad(Reply):
    """What one stage read to hold an adapter."""

    digest: str | None
    """hex SHA-256 of the adapter's tensors on that stage"""
    read: int = Field(ge=0)
    """adapter tensors the stage read (those of its layers)"""
    stored: int = Field(ge=0)
    """adapter tensors in the file"""
    modules: int = Field(ge=0)
    """modules of the stage the adapter changes"""


class AdapterLoaded(Reply):
    """A 200 from POST /admin/v1/adapters: requests may choose the adapter now."""

    accepted: Literal[True]
    """always true"""
    name: str
    """the name requests send as model"""
    path: str
    """its directory, as the coordinator resolved it"""
    stages: list[AdapterStageLoad]
    """each stage's load, in stage order"""


class AdapterUnloaded(Reply):
    """A 200 from POST /admin/v1/adapters/unload: no stage holds it any more."""

    accepted: Literal[True]
    """always true"""
    name: str
    """the adapter's name"""
    unloaded: Literal[True]
    """always true"""
