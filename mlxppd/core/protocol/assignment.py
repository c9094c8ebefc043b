"""Zero-config stage assignment: the messages and the peer's verdict, as pure data.

The coordinator and each ``--pp-peer`` talk over the secure transport in phases:
hello (the peer describes itself) -> offer -> accept / refuse -> commit -> activate. A peer
starts its stage only on activate, and the coordinator activates only after every peer
committed, so a single refusal or timeout means nothing starts anywhere.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from mlxppd.core.strict import StrictModel

__all__ = [
    "AssignmentCommand",
    "AssignmentReply",
    "HelloReply",
    "ModelIdentity",
    "Offer",
    "RefusalReason",
    "check_offer",
    "parse_assignment",
]

Rid = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
#: a host's memory as a peer reports it; 1 PiB is beyond any host
MAX_MEMORY_BYTES = 1 << 50


class ModelIdentity(StrictModel):
    """What makes two hosts' checkpoints the same model."""

    config_sha256: str = Field(max_length=64, description="SHA-256 of config.json's bytes")
    files: list[tuple[str, int]] = Field(
        max_length=4096, description="weight file names and sizes (bytes), sorted by name"
    )
    num_layers: int = Field(ge=1, le=1 << 20)

    def differences(self, other: ModelIdentity) -> list[str]:
        """Human-readable differences from ``other`` (empty: the same model)."""
        out = []
        if self.num_layers != other.num_layers:
            out.append(f"{self.num_layers} layers here, {other.num_layers} offered")
        if self.config_sha256 != other.config_sha256:
            out.append("config.json differs")
        mine, theirs = dict(self.files), dict(other.files)
        for name in sorted(set(mine) | set(theirs)):
            if name not in mine:
                out.append(f"no {name} here")
            elif name not in theirs:
                out.append(f"{name} is not in the offered model")
            elif mine[name] != theirs[name]:
                out.append(f"{name} is {mine[name]} bytes here, {theirs[name]} offered")
        return out


class RefusalReason(enum.StrEnum):
    MODEL_MISMATCH = "model_mismatch"
    VERSION_MISMATCH = "version_mismatch"
    CLUSTER_MISMATCH = "cluster_mismatch"
    ALREADY_ASSIGNED = "already_assigned"
    INVALID_OFFER = "invalid_offer"


class Hello(StrictModel):
    op: Literal["hello"] = "hello"
    rid: Rid = 0


class Offer(StrictModel):
    op: Literal["offer"] = "offer"
    rid: Rid = 0
    node_id: str = Field(min_length=1, max_length=128)
    stage: int = Field(ge=0, le=4096)
    layers: tuple[int, int]
    model: ModelIdentity
    version: str = Field(max_length=64)
    cluster: str = Field(min_length=1, max_length=256)
    topology: str = Field(max_length=1 << 20, description="the whole cluster TOML")


class Commit(StrictModel):
    op: Literal["commit"] = "commit"
    rid: Rid = 0


class Activate(StrictModel):
    op: Literal["activate"] = "activate"
    rid: Rid = 0


class Abort(StrictModel):
    op: Literal["abort"] = "abort"
    rid: Rid = 0
    reason: str = Field("", max_length=1024)


AssignmentCommand = Hello | Offer | Commit | Activate | Abort
_ADAPTER: TypeAdapter[AssignmentCommand] = TypeAdapter(
    Annotated[AssignmentCommand, Field(discriminator="op")]
)


def parse_assignment(meta: Any) -> AssignmentCommand:
    """A control message's metadata as its typed command (pydantic ValidationError if bad)."""
    return _ADAPTER.validate_python(dict(meta))


class HelloReply(StrictModel):
    """A peer describes itself: what the coordinator plans with."""

    rid: Rid = 0
    ok: bool = True
    version: str = Field(max_length=64)
    cluster: str = Field(max_length=256)
    model: ModelIdentity
    memory_bytes: int | None = Field(None, gt=0, lt=MAX_MEMORY_BYTES)
    address: str = Field(max_length=300)


class AssignmentReply(StrictModel):
    """A peer's answer to an offer, commit, activate or abort (or to a command it refused)."""

    rid: Rid = 0
    ok: bool
    reason: RefusalReason | None = None
    message: str | None = Field(None, max_length=1000)


def check_offer(
    offer: Offer, *, model: ModelIdentity, version: str, cluster: str, assigned: bool
) -> tuple[RefusalReason, str] | None:
    """None to accept ``offer``; otherwise the typed reason and one sentence for the logs."""
    if assigned:
        return RefusalReason.ALREADY_ASSIGNED, "this peer already accepted another offer"
    if offer.version != version:
        return (
            RefusalReason.VERSION_MISMATCH,
            f"mlxpp {version} here, {offer.version} on the coordinator; upgrade every host",
        )
    if offer.cluster != cluster:
        return (
            RefusalReason.CLUSTER_MISMATCH,
            f"cluster '{cluster}' here, '{offer.cluster}' offered; check --cluster-name",
        )
    differences = offer.model.differences(model) if offer.model != model else []
    if differences:
        return (
            RefusalReason.MODEL_MISMATCH,
            "the offered model is not the one here: " + "; ".join(differences[:5]),
        )
    if (
        offer.layers[0] < 0
        or offer.layers[1] > model.num_layers
        or offer.layers[0] >= offer.layers[1]
    ):
        return RefusalReason.INVALID_OFFER, f"layers {offer.layers} do not fit the model"
    return None
