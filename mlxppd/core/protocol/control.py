"""The pipeline's control plane: every command and every reply, as frozen pydantic models.

The coordinator sends a command in a CONTROL message; a stage answers with a REPLY that echoes
the command's request id (``rid``). Each message's metadata is exactly its model's
``model_dump``: built by the sender, parsed by the receiver, with every field bounded. A stage
parses a command with :func:`parse_control` (one discriminated union on ``op``: an unknown op or
an unknown field is refused by name); the coordinator parses a reply into the model it expects
(``runtime/control_client.py``). A stage's status report (:class:`StageReport`) travels in
metadata too, so its free text is clipped before it is built (:func:`clip`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    PlainSerializer,
    PlainValidator,
    TypeAdapter,
    WithJsonSchema,
)

from mlxppd.core.kv_admission import AdmissionDiagnostic, RejectReason
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.protocol.adapters import AdapterLoad, AdapterName, AdapterUnload
from mlxppd.core.protocol.model_transfer import (
    Identify,
    PrepareCheck,
    PrepareCommit,
    PrepareData,
)
from mlxppd.core.strict import StrictModel

__all__ = [
    "Ack",
    "Admission",
    "Admit",
    "AdmitRefusal",
    "AdmitReply",
    "Command",
    "Configure",
    "Forget",
    "LatencyReport",
    "LayerLoad",
    "ReassignReply",
    "Reassign",
    "Release",
    "ReloadReport",
    "StageExtras",
    "StageReport",
    "Status",
    "TraceDump",
    "TraceEvent",
    "TraceReply",
    "WireCounters",
    "clip",
    "parse_control",
    "parse_trace_events",
]

SeqId = Annotated[str, Field(min_length=1, max_length=128)]
#: request id: numbered by the sender's request helper, echoed in the reply
Rid = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Count = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Seconds = Annotated[float, Field(ge=0.0)]
Microseconds = Annotated[float, Field(ge=0.0)]
LayerPair = tuple[Annotated[int, Field(ge=0, le=1 << 20)], Annotated[int, Field(ge=0, le=1 << 20)]]
_PAIR: TypeAdapter[tuple[int, int]] = TypeAdapter(LayerPair)


def _layer_range(value: Any) -> LayerRange:
    """A ``[start, end)`` pair on the wire, refused unless 0 <= start < end."""
    if isinstance(value, LayerRange):
        return value
    start, end = _PAIR.validate_python(value)
    return LayerRange(start, end)


#: one stage's layers: a LayerRange in the code, a [start, end) pair on the wire
WireLayerRange = Annotated[
    LayerRange,
    PlainValidator(_layer_range),
    PlainSerializer(lambda r: r.pair, return_type=tuple[int, int]),
    WithJsonSchema(_PAIR.json_schema()),
]
#: every stage's layers, in stage order: the one form a plan takes across the project
Plan = tuple[WireLayerRange, ...]
#: bytes of JSON one free-text field (an error, the BLAS) may take: two of them, the rest of a
#: stage report at its largest and the envelope stay within the default 4096 metadata bytes
MAX_TEXT_BYTES = 600
CounterKey = Annotated[str, Field(min_length=1, max_length=64)]
Counters = Annotated[dict[CounterKey, Count], Field(max_length=64)]


def text_bytes(text: str) -> int:
    """The bytes ``text`` takes as a JSON string's contents (UTF-8, escapes included)."""
    return len(json.dumps(text, ensure_ascii=False).encode()) - 2


def _bounded(text: str) -> str:
    if (n := text_bytes(text)) > MAX_TEXT_BYTES:
        raise ValueError(f"text of {n} bytes; at most {MAX_TEXT_BYTES} (clip it)")
    return text


Text = Annotated[str, AfterValidator(_bounded)]


def clip(text: str | None, limit: int = MAX_TEXT_BYTES) -> str | None:
    """``text`` cut (with an ellipsis) to ``limit`` bytes of JSON; None stays None."""
    if text is None or text_bytes(text) <= limit:
        return text
    cut = text[:limit]
    while cut and (excess := text_bytes(cut) + 3 - limit) > 0:
        cut = cut[: -max(1, excess // 6)]  # a character takes at most 6 bytes of JSON
    return cut + "…"


# -- commands (coordinator -> stage) ---------------------------------------------------------


#: most tokens of a prompt, or of a completion, that one sequence may ask a stage for
MAX_SEQUENCE_TOKENS = 1 << 24
#: sampling seeds are unsigned 64-bit, as mlx's PRNG key takes them
MAX_SEED = (1 << 64) - 1


class Admit(StrictModel):
    """Dry-run (``commit`` false) or reserve the KV bytes of one sequence."""

    op: Literal["admit"] = "admit"
    rid: Rid = 0
    seq: SeqId
    prompt_tokens: int = Field(ge=1, le=MAX_SEQUENCE_TOKENS)
    max_tokens: int = Field(ge=1, le=MAX_SEQUENCE_TOKENS)
    commit: bool = Field(description="false: dry run only; true: reserve the KV bytes")
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    first_draw: int = Field(
        0,
        ge=0,
        le=MAX_SEQUENCE_TOKENS,
        description="the position of the sequence's next random draw: tokens it generated "
        "before (a replay after failover continues the same draws)",
    )
    plan: Plan | None = Field(
        None,
        max_length=4096,
        description="[start, end) layers of every stage as the coordinator expects them; a "
        "stage holding other layers refuses (plan_mismatch)",
    )
    adapter: AdapterName | None = Field(
        None, description="the per-request adapter the sequence runs (None: the base model)"
    )


class Release(StrictModel):
    """Free a sequence's KV (no reply); ``keep``: keep its caches as a prompt-cache entry."""

    op: Literal["release"] = "release"
    seq: SeqId
    keep: SeqId | None = Field(None, description="the entry id to keep the caches under")
    keep_tokens: int = Field(
        0, ge=0, le=2 * MAX_SEQUENCE_TOKENS, description="tokens the kept caches hold"
    )


class Forget(StrictModel):
    """Drop prompt-cache entries (no reply)."""

    op: Literal["forget"] = "forget"
    entries: list[SeqId] = Field(min_length=1, max_length=1024)


class Configure(StrictModel):
    """Tell a stage where its output goes (None on the last stage: back to the sender)."""

    op: Literal["configure"] = "configure"
    rid: Rid = 0
    next_host: str | None = Field(None, max_length=255)
    next_port: int | None = Field(None, ge=1, le=65535)
    next_node: str | None = Field(None, max_length=128)
    trace: bool = Field(False, description="record trace events until asked for them")
    heartbeat_interval_s: float | None = Field(
        None, gt=0, le=3600, description="send a heartbeat this often, seconds (None: never)"
    )
    heartbeat_timeout_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="nothing from the coordinator for this long, seconds: it is lost (the "
        "stage closes its channel and frees its KV; None: wait forever)",
    )


class TraceDump(StrictModel):
    """Send the recorded trace events (and forget them)."""

    op: Literal["trace"] = "trace"
    rid: Rid = 0


class Status(StrictModel):
    """Send a :class:`StageReport`."""

    op: Literal["status"] = "status"
    rid: Rid = 0


class Admission(StrictModel):
    """Open or close a stage's admission (an elastic drain closes every stage)."""

    op: Literal["admission"] = "admission"
    rid: Rid = 0
    open: bool
    state: str = Field("idle", max_length=32, description="elastic state to report meanwhile")


class Reassign(StrictModel):
    """Elastic resume, in two phases so that a failure anywhere changes nothing anywhere:
    ``prepare`` loads the stage's new layers beside the old, ``commit`` switches to them,
    ``abort`` drops what ``prepare`` loaded."""

    op: Literal["reassign"] = "reassign"
    rid: Rid = 0
    phase: Literal["prepare", "commit", "abort"]
    plan: Plan = Field(
        min_length=1, max_length=4096, description="[start, end) layers of every stage"
    )
    stage: int | None = Field(
        None,
        ge=0,
        le=4096,
        description="the stage this node becomes in ``plan`` (None: the one it is): a standby "
        "adopting a lost stage, survivors closing the gap",
    )


class Heartbeat(StrictModel):
    """Both ways on a coordinator's stage link, every interval: the link is alive (no reply)."""

    op: Literal["heartbeat"] = "heartbeat"


Command = (
    Admit
    | Release
    | Configure
    | Status
    | TraceDump
    | Admission
    | Reassign
    | Heartbeat
    | Forget
    | Identify
    | PrepareCheck
    | PrepareData
    | PrepareCommit
    | AdapterLoad
    | AdapterUnload
)
_CONTROL: TypeAdapter[Command] = TypeAdapter(Annotated[Command, Field(discriminator="op")])


def parse_control(meta: Any) -> Command:
    """A CONTROL message's metadata as its typed command (pydantic ValidationError if bad)."""
    return _CONTROL.validate_python(dict(meta))


# -- replies (stage -> coordinator) ----------------------------------------------------------


class Ack(StrictModel):
    """The reply to configure and admission, and to a reassign commit or abort."""

    rid: Rid = 0
    ok: bool = True
    error: Text | None = None


class AdmitRefusal(StrictModel):
    """Why a stage refused an admission, with its accounting at that moment (bytes)."""

    stage_index: int = Field(ge=0, le=4096)
    reason: RejectReason
    required_bytes: Count
    used_memory_bytes: Count
    budget_bytes: Count
    active_sequences: Count
    rank: int | None = Field(None, ge=0, le=4096)
    """the refusing tensor-parallel rank (None: a stage of one rank)"""
    detail: Text | None = None
    """invalid_request: what the stage cannot serve and what to change, one sentence"""

    @classmethod
    def of(cls, d: AdmissionDiagnostic, detail: str | None = None) -> AdmitRefusal:
        return cls(
            stage_index=d.stage_index,
            reason=d.reason,
            required_bytes=d.required_bytes,
            used_memory_bytes=d.used_memory_bytes,
            budget_bytes=d.budget_bytes,
            active_sequences=d.active_sequences,
            rank=d.rank,
            detail=clip(detail),
        )

    def diagnostic(self) -> AdmissionDiagnostic:
        return AdmissionDiagnostic(
            stage_index=self.stage_index,
            reason=self.reason,
            required_bytes=self.required_bytes,
            used_memory_bytes=self.used_memory_bytes,
            budget_bytes=self.budget_bytes,
            active_sequences=self.active_sequences,
            rank=self.rank,
        )


class AdmitReply(StrictModel):
    rid: Rid = 0
    ok: bool
    diagnostic: AdmitRefusal | None = None

    def refusal(self, stage_index: int) -> AdmissionDiagnostic | None:
        """None when admitted; otherwise the stage's diagnostic (or a bare one naming it)."""
        if self.ok:
            return None
        if self.diagnostic is not None:
            return self.diagnostic.diagnostic()
        return AdmissionDiagnostic(stage_index, RejectReason.REJECTED_BY_STAGE, 0, 0, 0, 0)


class LayerLoad(StrictModel):
    """What a stage read to take on a new layer range (prepare), and how long it took."""

    layers: LayerPair = Field(description="[start, end) of the new range")
    loaded_tensors: Count
    reused_tensors: Count
    load_s: Seconds


class ReassignReply(Ack):
    """The reply to every reassign phase; a successful prepare adds its :class:`LayerLoad`."""

    layers: LayerPair | None = None
    loaded_tensors: Count | None = None
    reused_tensors: Count | None = None
    load_s: Seconds | None = None

    def load(self) -> LayerLoad | None:
        if (
            self.layers is None
            or self.loaded_tensors is None
            or self.reused_tensors is None
            or self.load_s is None
        ):
            return None
        return LayerLoad(
            layers=self.layers,
            loaded_tensors=self.loaded_tensors,
            reused_tensors=self.reused_tensors,
            load_s=self.load_s,
        )


class TraceReply(StrictModel):
    """The reply to trace; the events travel as the message's tensor (JSON bytes)."""

    rid: Rid = 0
    events: bool = True


TraceArg = str | int | float | bool | None


class TraceEvent(StrictModel):
    """One Chrome / Perfetto trace event a stage recorded (runtime/trace.py)."""

    name: str = Field(min_length=1, max_length=128)
    ph: Literal["X", "i"]
    s: Literal["t"] | None = None
    ts: float
    dur: Microseconds | None = None
    pid: str = Field(min_length=1, max_length=128)
    tid: int = Field(ge=0, le=4096)
    args: dict[CounterKey, TraceArg] = Field(default_factory=dict, max_length=32)


#: events one trace reply may carry (a stage keeps at most 200 000)
MAX_TRACE_EVENTS = 1 << 20
_TRACE_EVENTS: TypeAdapter[list[TraceEvent]] = TypeAdapter(
    Annotated[list[TraceEvent], Field(max_length=MAX_TRACE_EVENTS)]
)


def parse_trace_events(payload: bytes) -> list[TraceEvent]:
    """A trace reply's tensor bytes as its events (pydantic ValidationError if bad)."""
    return _TRACE_EVENTS.validate_json(payload or b"[]")


# -- the stage report ------------------------------------------------------------------------


class LatencyReport(StrictModel):
    """Activation hand-off latency into a stage (core/stage_accounting.py's histogram)."""

    counts: list[Count] = Field(max_length=64, description="per bucket, the last one +Inf")
    sum: Seconds
    count: Count
    max: Seconds


class WireCounters(StrictModel):
    """One transport's counters (wire/stats.py), keyed by reason or verdict name."""

    handshake_failures: Counters = Field(default_factory=dict)
    rejected_frames: Counters = Field(default_factory=dict)
    verdicts_sent: Counters = Field(default_factory=dict)
    channels_established: Count = 0
    preauth_refused: Counters = Field(default_factory=dict)
    rekeys_sent: Count = 0
    rekeys_received: Count = 0
    revoked_channels: Count = 0


class ReloadReport(StrictModel):
    """The agent's last reload of its stage (drain, load, swap)."""

    layers: str = Field(max_length=32, description="first-last, inclusive")
    drain_s: Seconds
    load_s: Seconds
    total_s: Seconds
    loaded_tensors: Count
    reused_tensors: Count


class StageExtras(StrictModel):
    """What an agent adds to its stage's reports (None where a plain ``serve`` stage runs)."""

    node_id: str | None = Field(None, max_length=128)
    config_generation: str | None = Field(None, max_length=64)
    last_reload_error: Text | None = None
    reload_failures: Count | None = None
    memory_budget_bytes: Count | None = None
    last_reload: ReloadReport | None = None


class SlotReport(StrictModel):
    """One (stage, rank) slot of a tensor-parallel stage, as its rank 0 reports it."""

    rank: int = Field(ge=0, le=4096)
    node_id: str = Field(max_length=128)
    parameter_bytes: Count = Field(description="this rank's shard of the stage's weights")
    kv_used_bytes: Count
    kv_budget_bytes: Count = Field(description="UNLIMITED_BYTES when none is configured")


class MlxMemory(StrictModel):
    """mlx's allocator on a stage process: what arrays hold, and what it keeps for reuse."""

    active_bytes: Count = Field(description="bytes held by live arrays")
    cache_bytes: Count = Field(description="freed bytes kept for reuse (not given back to the OS)")
    peak_bytes: Count = Field(description="the most active bytes since the process started")


class StageReport(StageExtras):
    """A stage's status reply: what it holds, how busy it was, its counters and clock."""

    rid: Rid = 0
    stage: int = Field(ge=-1, le=4096, description="-1: a standby, serving no layers yet")
    layers: LayerPair = Field(description="[start, end) of the layers it serves")
    parameter_bytes: Count
    weights: str = Field(max_length=32, description="float32 or native")
    blas: Text
    kv_used_bytes: Count
    kv_budget_bytes: Count = Field(description="UNLIMITED_BYTES when none is configured")
    active_sequences: Count
    forwards: Count
    busy_fraction: float = Field(ge=0.0, le=1.0)
    protocol_errors: Count
    batched_passes: Count
    batched_rows: Count
    busy_s: Seconds
    active_s: Seconds
    wall_s: Seconds
    activation_latency: LatencyReport
    wire: WireCounters
    trace_dropped: Count
    admission: Literal["open", "draining"]
    elastic_state: str = Field(max_length=32)
    now: float = Field(description="the stage's wall clock when it answered, seconds")
    slots: list[SlotReport] = Field(
        default_factory=list,
        max_length=4096,
        description="a tensor-parallel stage's (stage, rank) slots, rank order; empty for a "
        "stage of one rank",
    )
    memory: MlxMemory | None = Field(default=None, description="absent from older stages")

    def activity(self) -> dict[str, float]:
        """The cumulative seconds ``core.stage_accounting.fractions`` compares."""
        return {"busy_s": self.busy_s, "active_s": self.active_s, "wall_s": self.wall_s}
