"""Identity and model shipping on a stage's channel, as frozen models.

``Identify`` asks a stage what it serves (the coordinator's check at connect and after every
layer move; ``--dry-run``'s version check). ``PrepareCheck`` / ``PrepareData`` /
``PrepareCommit`` are ``mlxppctl prepare``: the sender offers the cluster's records of the tensors
the stage's layers need (a JSON payload, bounded), the stage answers which it lacks and how many
bytes of an interrupted transfer it already holds, the sender streams the rest, and the stage
verifies every tensor's SHA-256 before it installs the copy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from mlxppd.core.model_identity import StageIdentity, TensorRecord
from mlxppd.core.strict import StrictModel

Rid = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Count = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
FamilyName = Annotated[str, Field(min_length=1, max_length=64)]

#: tensors one manifest may list (DeepSeek-V3's checkpoint has about 92 000)
MAX_MANIFEST_TENSORS = 1 << 18
#: bytes of a manifest payload (JSON)
MAX_MANIFEST_BYTES = 64 << 20
#: bytes of one PrepareData chunk
MAX_CHUNK_BYTES = 16 << 20
#: bytes of config.json a manifest may carry
MAX_CONFIG_BYTES = 1 << 20


class Identify(StrictModel):
    """Send an :class:`IdentityReply`."""

    op: Literal["identify"] = "identify"
    rid: Rid = 0


ModelState = Literal["loaded", "standby", "missing"]


class IdentityReply(StrictModel):
    """What a stage serves and what it can run."""

    rid: Rid = 0
    package_version: str = Field(max_length=64)
    protocol_version: int = Field(ge=0, le=65535)
    families: list[FamilyName] = Field(max_length=64, description="wire names it can run")
    family: str = Field("", max_length=64, description="wire name of what it serves")
    model_state: ModelState
    identity: StageIdentity | None = None
    detail: str = Field("", max_length=600, description="why the model is missing")


class PrepareManifest(StrictModel):
    """The cluster's copy of what one stage needs (travels as the check's JSON payload)."""

    model_name: str = Field(min_length=1, max_length=128)
    config: dict[str, Any]
    layers: tuple[Count, Count]
    stage: int = Field(ge=0, le=4096)
    num_stages: int = Field(ge=1, le=4096)
    records: list[TensorRecord] = Field(max_length=MAX_MANIFEST_TENSORS)


_MANIFEST: TypeAdapter[PrepareManifest] = TypeAdapter(PrepareManifest)


def parse_manifest(payload: bytes) -> PrepareManifest:
    if len(payload) > MAX_MANIFEST_BYTES:
        raise ValueError(f"a manifest of {len(payload)} bytes; at most {MAX_MANIFEST_BYTES}")
    manifest = _MANIFEST.validate_json(payload)
    if len(str(manifest.config)) > MAX_CONFIG_BYTES:
        raise ValueError("the manifest's config is too large")
    return manifest


class PrepareCheck(StrictModel):
    """Compare the manifest (the payload) with what this node holds; plan the transfer."""

    op: Literal["prepare_check"] = "prepare_check"
    rid: Rid = 0


class PrepareState(StrictModel):
    """The node's copy against the manifest; the needed tensors' names travel as payload."""

    rid: Rid = 0
    ok: bool = True
    error: str | None = Field(None, max_length=600)
    state: Literal["present", "missing", "mismatch"] = "present"
    present: Count = 0
    missing: Count = 0
    mismatched: Count = 0
    needed_bytes: Count = Field(0, description="bytes of the tensors to send")
    have_bytes: Count = Field(0, description="of those, already here from an interrupted send")


class PrepareData(StrictModel):
    """``payload`` continues the planned stream at ``offset`` (no reply)."""

    op: Literal["prepare_data"] = "prepare_data"
    offset: Count


class PrepareCommit(StrictModel):
    """Verify every received tensor and install the copy."""

    op: Literal["prepare_commit"] = "prepare_commit"
    rid: Rid = 0


class PrepareResult(StrictModel):
    rid: Rid = 0
    ok: bool
    error: str | None = Field(None, max_length=600)
    identity: StageIdentity | None = None
    verified_bytes: Count = 0
