"""Identity and model shipping on a stage's channel, as frozen models.

``Identify`` asks a stage what it serves (the coordinator's check at connect and after every
layer move; ``--dry-run``'s version check). ``PrepareCheck`` / ``PrepareData`` /
``PrepareCommit`` are ``mlxppctl prepare``: the sender offers the cluster's records of the tensors
the stage's layers need and of the model directory's tokenizer files (a JSON payload, bounded),
the stage answers which it lacks and how many bytes of an interrupted transfer it already holds,
the sender streams the rest (tensors, then files), and the stage verifies every tensor's and
file's SHA-256 before it installs the copy.

A manifest is checked whole at the edge (``parse_manifest``): each tensor named once, by a
name a safetensors file can hold as a tensor, with a byte count its dtype and shape agree
with; each file named once, by a plain name from ``MODEL_FILES``, within the size bounds; a
node never builds a copy from one that is not.
"""

from __future__ import annotations

import math
import unicodedata
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from mlxppd.core.log_text import escape, quoted
from mlxppd.core.model_identity import Sha256, StageIdentity, TensorRecord
from mlxppd.core.strict import StrictModel

Rid = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Count = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
FamilyName = Annotated[str, Field(min_length=1, max_length=64)]
FileName = Annotated[str, Field(min_length=1, max_length=64)]

#: tensors one manifest may list (DeepSeek-V3's checkpoint has about 92 000)
MAX_MANIFEST_TENSORS = 1 << 18
#: bytes of a manifest payload (JSON)
MAX_MANIFEST_BYTES = 64 << 20
#: bytes of one PrepareData chunk
MAX_CHUNK_BYTES = 16 << 20
#: bytes of config.json a manifest may carry
MAX_CONFIG_BYTES = 1 << 20
#: the model directory's non-weight files a prepared copy carries beside config.json: what a
#: stage needs to load the tokenizer (the last stage compiles output grammars against it)
MODEL_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "generation_config.json", "chat_template.jinja", "chat_template.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
)  # fmt: skip
#: bytes of one such file (the largest tokenizer.json files are a few tens of MiB)
MAX_MODEL_FILE_BYTES = 64 << 20
#: bytes of all of them together
MAX_MODEL_FILES_BYTES = 128 << 20
#: the safetensors header key that holds the file's metadata, never a tensor
METADATA_KEY = "__metadata__"
#: bytes per element of each safetensors dtype a node installs
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


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


class FileRecord(StrictModel):
    """One of the model directory's ``MODEL_FILES`` as the cluster's copy holds it."""

    name: FileName
    nbytes: Count
    sha256: Sha256


class PrepareManifest(StrictModel):
    """The cluster's copy of what one stage needs (travels as the check's JSON payload)."""

    model_name: str = Field(min_length=1, max_length=128)
    config: dict[str, Any]
    layers: tuple[Count, Count]
    stage: int = Field(ge=0, le=4096)
    num_stages: int = Field(ge=1, le=4096)
    records: list[TensorRecord] = Field(max_length=MAX_MANIFEST_TENSORS)
    files: list[FileRecord] = Field(default_factory=list, max_length=len(MODEL_FILES))

    @model_validator(mode="after")
    def _coherent(self) -> PrepareManifest:
        problem = manifest_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self


def tensor_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a tensor of an installed copy, as a clause (None: it can)."""
    if name == METADATA_KEY:
        return "is the key safetensors reserves for a file's metadata, not a tensor name"
    if "/" in name or "\\" in name:
        return "holds a path separator; tensor names are keys such as model.embed_tokens.weight"
    if any(unicodedata.category(c).startswith("C") for c in name):
        return "holds a control, format or unassigned character (NUL among them)"
    return None


def file_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a file of an installed copy, as a clause (None: it can)."""
    if "/" in name or "\\" in name or ".." in name:
        return "is a path; a model file is named plainly, as tokenizer.json"
    if name not in MODEL_FILES:
        return f"is not one of the files a prepared copy carries ({', '.join(MODEL_FILES)})"
    return None


def files_problem(files: list[FileRecord]) -> str | None:
    """The first thing that makes ``files`` impossible to install, naming the field."""
    seen: set[str] = set()
    for index, record in enumerate(files):
        field = f"files[{index}]"
        problem = file_name_problem(record.name)
        if problem is not None:
            return f"{field}.name: {quoted(record.name, 80)} {problem}"
        if record.name in seen:
            return f"{field}.name: {quoted(record.name, 80)} is listed twice"
        seen.add(record.name)
        if record.nbytes > MAX_MODEL_FILE_BYTES:
            return (
                f"{field}.nbytes: {record.nbytes}; a model file is at most {MAX_MODEL_FILE_BYTES}"
            )
    total = sum(r.nbytes for r in files)
    if total > MAX_MODEL_FILES_BYTES:
        return f"files: {total} bytes in all; at most {MAX_MODEL_FILES_BYTES}"
    return None


def record_problem(record: TensorRecord) -> str | None:
    """Why ``record`` (its name aside) cannot be installed, as a clause (None: it can)."""
    size = DTYPE_BYTES.get(record.dtype)
    if size is None:
        return f"dtype {quoted(record.dtype)} is not one of {', '.join(DTYPE_BYTES)}"
    if math.prod(record.shape) * size != record.nbytes:
        return (
            f"nbytes {record.nbytes} is not what dtype {record.dtype} and shape {record.shape} hold"
        )
    return None


def manifest_problem(manifest: PrepareManifest) -> str | None:
    """The first thing that makes ``manifest`` impossible to install, naming the field."""
    start, end = manifest.layers
    if start > end:
        return f"layers: [{start}, {end}) ends before it starts"
    if manifest.stage >= manifest.num_stages:
        return f"stage: {manifest.stage} is not below num_stages ({manifest.num_stages})"
    first: dict[str, int] = {}
    for index, record in enumerate(manifest.records):
        field = f"records[{index}]"
        problem = tensor_name_problem(record.name)
        if problem is not None:
            return f"{field}.name: {quoted(record.name, 80)} {problem}"
        if record.name in first:
            return (
                f"{field}.name: {quoted(record.name, 80)} is listed twice (records"
                f"[{first[record.name]}] too); a manifest names each tensor once"
            )
        first[record.name] = index
        problem = record_problem(record)
        if problem is not None:
            return f"{field}: {problem}"
    return files_problem(manifest.files)


class ManifestError(ValueError):
    """A prepare manifest refused at the edge; the message names the field."""


_MANIFEST: TypeAdapter[PrepareManifest] = TypeAdapter(PrepareManifest)


def parse_manifest(payload: bytes) -> PrepareManifest:
    """The manifest in a check's payload, or a :class:`ManifestError` in one sentence."""
    if len(payload) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"a manifest of {len(payload)} bytes; at most {MAX_MANIFEST_BYTES}")
    try:
        manifest = _MANIFEST.validate_json(payload)
    except ValidationError as exc:
        raise ManifestError(f"the prepare manifest was refused: {_first_error(exc)}") from None
    if len(str(manifest.config)) > MAX_CONFIG_BYTES:
        raise ManifestError("the prepare manifest was refused: config: it is too large")
    return manifest


def _first_error(exc: ValidationError) -> str:
    """The first problem as ``field: message``, without echoing the input (pydantic's text
    quotes it, and a peer's text does not belong in a reply or a log line unescaped)."""
    error = exc.errors(include_url=False, include_input=False)[0]
    message = str(error["msg"]).removeprefix("Value error, ")
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
    where = escape(where.lstrip("."), 120)  # an unknown key's name is the peer's text
    return f"{where}: {message}" if where else message


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
    needed_bytes: Count = Field(0, description="bytes of the tensors and files to send")
    have_bytes: Count = Field(0, description="of those, already here from an interrupted send")
    files: list[FileName] = Field(
        default_factory=list,
        max_length=len(MODEL_FILES),
        description="the model files to send, in order, after the tensors",
    )


class PrepareData(StrictModel):
    """``payload`` continues the planned stream at ``offset`` (no reply)."""

    op: Literal["prepare_data"] = "prepare_data"
    offset: Count


class PrepareCommit(StrictModel):
    """Verify every received tensor and file and install the copy."""

    op: Literal["prepare_commit"] = "prepare_commit"
    rid: Rid = 0


class PrepareResult(StrictModel):
    rid: Rid = 0
    ok: bool
    error: str | None = Field(None, max_length=600)
    identity: StageIdentity | None = None
    verified_bytes: Count = 0
