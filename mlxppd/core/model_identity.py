"""What a stage serves, as values two nodes can compare (pure).

A checkpoint tensor is known by its :class:`TensorRecord`: name, stored dtype and shape, byte
count and the SHA-256 of its stored bytes. A stage's :class:`StageIdentity` is the model's
config fingerprint, family and quantization plus one digest over the records of exactly the
tensors its layer range owns (``core/stage_tensors.py``), so a node holding only its own layers
can be checked, and the same records tell ``mlxppctl prepare`` which tensors a node lacks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from mlxppd.core.strict import StrictModel

__all__ = [
    "IdentityCheck",
    "check_stage",
    "difference",
    "StageIdentity",
    "TensorRecord",
    "Triage",
    "config_sha256",
    "identity_of",
    "quantization_of",
    "triage",
]

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]


class TensorRecord(StrictModel):
    """One checkpoint tensor as stored in a safetensors file."""

    name: str = Field(min_length=1, max_length=512)
    dtype: str = Field(min_length=1, max_length=16, description="safetensors dtype, e.g. F16")
    shape: list[Annotated[int, Field(ge=0, le=1 << 40)]] = Field(max_length=8)
    nbytes: Count
    sha256: Sha256


class StageIdentity(StrictModel):
    """The identity of what one stage serves."""

    config_sha256: Sha256
    family: str = Field(max_length=64, description="config.json's model_type")
    quantization: str = Field(max_length=32, description='"none", or e.g. "4-bit/64"')
    layers: tuple[Count, Count] = Field(description="[start, end) of the layers it covers")
    tensors_sha256: Sha256 = Field(description="SHA-256 over its tensors' records, name order")
    tensors: Count
    nbytes: Count = Field(description="checkpoint bytes of those tensors")
    adapters: dict[Annotated[str, Field(max_length=64)], Sha256] = Field(
        default_factory=dict,
        max_length=65,
        description="SHA-256 of each adapter over the stage's layers, by name ('' = fused)",
    )

    def short(self) -> str:
        """The digest as a log line shows it."""
        return self.tensors_sha256[:16]


def config_sha256(config: Mapping[str, Any]) -> str:
    """A fingerprint of config.json's content (key order and spacing do not count)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def quantization_of(config: Mapping[str, Any]) -> str:
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    return f"{bits}-bit/{quant.get('group_size')}" if bits else "none"


def identity_of(
    records: Iterable[TensorRecord], config: Mapping[str, Any], layers: tuple[int, int]
) -> StageIdentity:
    """The identity of a stage holding exactly ``records`` (its owned tensors)."""
    ordered = sorted(records, key=lambda r: r.name)
    digest = hashlib.sha256()
    for r in ordered:
        digest.update(json.dumps([r.name, r.dtype, r.shape, r.sha256]).encode() + b"\n")
    return StageIdentity(
        config_sha256=config_sha256(config),
        family=str(config.get("model_type", "")),
        quantization=quantization_of(config),
        layers=layers,
        tensors_sha256=digest.hexdigest(),
        tensors=len(ordered),
        nbytes=sum(r.nbytes for r in ordered),
    )


IdentityState = Literal["verified", "mismatch", "missing", "unverified"]


class IdentityCheck(StrictModel):
    """What the coordinator found when it compared one stage with the cluster's copy."""

    node: str = Field(max_length=128)
    stage: int = Field(ge=-1, le=4096)
    state: IdentityState
    detail: str = Field("", max_length=2000)
    expected: StageIdentity | None = None
    actual: StageIdentity | None = None


def difference(expected: StageIdentity, actual: StageIdentity) -> str | None:
    """How ``actual`` differs from ``expected``, in a clause (None: the same)."""
    if expected.family != actual.family:
        return f"its model family is {actual.family!r}, the cluster's is {expected.family!r}"
    if expected.config_sha256 != actual.config_sha256:
        return (
            f"its config.json differs (sha256 {actual.config_sha256[:16]}, the cluster's "
            f"{expected.config_sha256[:16]})"
        )
    if expected.quantization != actual.quantization:
        return f"it is quantized {actual.quantization}, the cluster's copy {expected.quantization}"
    if expected.layers != actual.layers:
        return f"it covers layers {actual.layers}, the cluster expects {expected.layers}"
    adapters = _adapter_difference(expected.adapters, actual.adapters)
    if adapters is not None:
        return adapters
    if expected.tensors_sha256 != actual.tensors_sha256:
        return (
            f"its tensors differ: sha256 {actual.short()} over {actual.tensors} tensors, the "
            f"cluster's copy has {expected.short()} over {expected.tensors}"
        )
    return None


def _adapter_difference(expected: Mapping[str, str], actual: Mapping[str, str]) -> str | None:
    """The fused adapter ('') must be the cluster's or absent on both; a named adapter both
    hold must be the same file (one a stage lacks is loaded again, not a different model)."""
    want, have = expected.get(""), actual.get("")
    if want != have:
        if have is None:
            return f"it has no fused adapter, the cluster's has sha256 {str(want)[:16]}"
        if want is None:
            return f"it has a fused adapter (sha256 {have[:16]}), the cluster none"
        return f"its fused adapter differs: sha256 {have[:16]}, the cluster's {want[:16]}"
    for name in sorted(set(expected) & set(actual) - {""}):
        if expected[name] != actual[name]:
            return (
                f"its adapter {name!r} differs: sha256 {actual[name][:16]}, the cluster's "
                f"{expected[name][:16]}"
            )
    return None


@dataclass(frozen=True)
class Triage:
    """A node's copy of the tensors a stage needs, against the cluster's records."""

    present: tuple[str, ...]
    missing: tuple[str, ...]
    """names the node does not hold at all"""
    mismatched: tuple[str, ...]
    """names the node holds with other bytes, dtype or shape"""

    @property
    def state(self) -> Literal["present", "missing", "mismatch"]:
        if self.mismatched:
            return "mismatch"
        return "missing" if self.missing else "present"

    @property
    def needed(self) -> tuple[str, ...]:
        return tuple(sorted(self.missing + self.mismatched))


def triage(expected: Iterable[TensorRecord], local: Mapping[str, TensorRecord]) -> Triage:
    """Which of ``expected`` the node holds as they are, lacks, or holds otherwise."""
    present, missing, mismatched = [], [], []
    for record in expected:
        have = local.get(record.name)
        if have is None:
            missing.append(record.name)
        elif have != record:
            mismatched.append(record.name)
        else:
            present.append(record.name)
    return Triage(tuple(present), tuple(missing), tuple(mismatched))


def check_stage(
    node: str,
    stage: int,
    *,
    model_state: str,
    family: str,
    families: Iterable[str],
    actual: StageIdentity | None,
    expected: StageIdentity | None,
    cluster_family: str,
    detail: str = "",
) -> IdentityCheck:
    """One stage against the cluster's copy: the family it can run (the spec's "pipeline
    capability"), then what it serves. ``expected`` None: the coordinator's copy holds none
    of that stage's tensors, so only the family and the config can be compared."""
    where = f"stage {stage} (node {node})"
    if model_state == "missing":
        return IdentityCheck(
            node=node,
            stage=stage,
            state="missing",
            detail=f"model_missing: {where} holds no copy of the model ({detail}); run "
            "`mlxppctl prepare` to ship it the coordinator's",
            expected=expected,
        )
    if cluster_family not in set(families):
        return IdentityCheck(
            node=node,
            stage=stage,
            state="mismatch",
            detail=f"pipeline capability mismatch: {where} cannot run the model's family "
            f"{cluster_family!r}; upgrade mlxpp on that node",
        )
    if model_state != "loaded" or actual is None:
        return IdentityCheck(node=node, stage=stage, state="unverified", detail="holds no layers")
    if family and family != cluster_family:
        return IdentityCheck(
            node=node,
            stage=stage,
            state="mismatch",
            detail=f"model_mismatch: {where} serves a {family!r} model, the cluster's is "
            f"{cluster_family!r}",
            actual=actual,
        )
    if expected is None or expected.tensors == 0:
        return IdentityCheck(
            node=node,
            stage=stage,
            state="unverified",
            detail="the coordinator's copy holds none of this stage's tensors",
            actual=actual,
        )
    if (why := difference(expected, actual)) is not None:
        return IdentityCheck(
            node=node,
            stage=stage,
            state="mismatch",
            detail=f"model_mismatch: {where}: {why}; run `mlxppctl prepare` to repair it from "
            "the coordinator's copy",
            expected=expected,
            actual=actual,
        )
    return IdentityCheck(node=node, stage=stage, state="verified", expected=expected, actual=actual)
