"""The admin status document (``GET /admin/v1/status``) and its parts, as frozen pydantic models.

The coordinator builds it (``runtime/agent/status.py``), the admin API adds the health badge
and serves ``model_dump(mode="json")`` (``http/admin_api.py``), ``mlxppctl`` parses the JSON
back into the same models (``cli/ctl_status.py``) and the web console reads the same JSON;
``http/admin_openapi.py`` publishes their schemas. docs/admin-api.md says what the fields mean.

Every key is always sent (``null`` where a value is unknown) except the few typed
``X | MISSING``: those are left out of the JSON when they do not apply, never sent as null.
An unknown key is refused when the JSON is parsed, so a field added on one side only fails
the tests rather than vanishing. Counts carry their bounds; measured seconds and rates do
not, so that a clock step never turns the status into an error.
"""

from __future__ import annotations

from typing import Literal

from pydantic import MISSING, ConfigDict, Field

from mlxppd.core.agent.elastic import ElasticState, Outcome, Trigger
from mlxppd.core.model_identity import IdentityState
from mlxppd.core.protocol.control import LayerLoad
from mlxppd.core.strict import StrictModel

__all__ = [
    "AdapterStatus",
    "ClusterStatus",
    "CoordinatorStatus",
    "FailoverRecord",
    "HealthBadge",
    "IdentityStatus",
    "NamedAdapter",
    "NodeCard",
    "PrepareNodeProgress",
    "PrepareStatus",
    "RepartitionEventRecord",
    "RepartitionEvents",
    "SlotStatus",
    "StageCard",
    "StatusDocument",
]

#: the whole cluster in one word (``mlxppd/core/agent/health.py`` decides it)
HealthBadge = Literal["healthy", "degraded", "unhealthy"]


class StatusModel(StrictModel):
    """Frozen, unknown keys refused; each field's docstring is its schema description."""

    model_config = ConfigDict(use_attribute_docstrings=True)


class SlotStatus(StatusModel):
    """One (stage, rank) slot of a tensor-parallel stage, as its rank 0 reported it."""

    rank: int = Field(ge=0)
    """the rank within its stage, 0 first"""
    node_id: str
    """the node that runs this rank"""
    parameter_bytes: int = Field(ge=0)
    """bytes of this rank's shard of the stage's weights"""
    kv_used_bytes: int = Field(ge=0)
    """bytes of KV cache this rank holds now"""
    kv_budget_bytes: int | None = Field(ge=0)
    """bytes of KV cache this rank may hold; null: unlimited"""


class IdentityStatus(StatusModel):
    """What the coordinator last found when it compared a stage's model with its own copy."""

    state: IdentityState
    """verified, mismatch, missing (no copy on that host) or unverified"""
    detail: str
    """the sentence saying why ("" when there is nothing to say)"""
    expected_sha256: str | None
    """hex SHA-256 of the stage's tensors in the coordinator's copy; null when unknown"""
    actual_sha256: str | None
    """hex SHA-256 of the tensors the stage serves; null when unknown"""


class NodeCard(StatusModel):
    """One node of the pipeline or a standby: where it is, and what its own report said
    (null for all of that when it did not answer)."""

    stage: int | None = Field(ge=0)
    """the stage index it serves; null for a standby that serves none"""
    node_id: str
    """the node's id in the cluster TOML"""
    address: str
    """host:port of its stage transport"""
    role: Literal["pipeline_stage", "standby"]
    """a stage of the file's pipeline, or a standby node (idle, or in a lost stage's place)"""
    layers: str | None
    """the inclusive layer range it serves, e.g. "0-14"; null when unknown or none"""
    process_alive: bool | None
    """it answered just now; false: its link failed; null: not asked (pipeline down)"""
    transport_connected: bool
    """the coordinator's link to it is up"""
    in_flight: int | None = Field(ge=0)
    """sequences it holds now"""
    kv_used_bytes: int | None = Field(ge=0)
    """bytes of KV cache in use"""
    kv_budget_bytes: int | None = Field(ge=0)
    """bytes of KV cache it may use; null: unlimited, or unknown"""
    elastic_state: str | None
    """its side of an elastic repartition: idle unless one is under way"""
    config_generation: str | None
    """the configuration it runs (the coordinator's should match)"""
    last_reload_error: str | None
    """why its last configuration reload failed; null: none failed"""
    memory_budget_bytes: int | None = Field(ge=0)
    """bytes of memory its node gives the stage; null: no budget"""
    weights: str | None
    """float32 (materialized at load for a CPU host) or native (as the checkpoint stores them)"""
    blas: str | None
    """the BLAS under mlx's CPU matmuls on that node"""
    parameter_bytes: int | None = Field(ge=0)
    """bytes of weights it holds (rank 0's shard for a tensor-parallel stage)"""
    slots: tuple[SlotStatus, ...]
    """a tensor-parallel stage's (stage, rank) slots in rank order; empty for one rank"""


class StageCard(NodeCard):
    """One stage of the pipeline as it serves now, in stage order."""

    identity: IdentityStatus | None
    """the coordinator's last check of the model it serves; null before any check"""


class FailoverRecord(StatusModel):
    """One lost stage and what became of it (docs/failover.md)."""

    lost_stage: int = Field(ge=0)
    """the stage index that was lost"""
    lost_node: str
    """the node that served it"""
    reason: str
    """why it counted as lost (a closed link, no heartbeat)"""
    outcome: str
    """the path that recovered: reconnected, standby, survivors, or failed"""
    detail: str
    """what that path did, in a sentence"""
    seconds: float
    """seconds from the loss to the new pipeline (or to giving up)"""
    sequences: int = Field(ge=0)
    """sequences in flight at the loss, each replayed when it recovered"""
    at: float
    """wall clock of the loss, Unix seconds"""


class PrepareNodeProgress(StatusModel):
    """One node's part of a prepare: what it held and what was sent."""

    node: str
    """the node's id"""
    stage: int = Field(ge=0)
    """the stage index whose tensors it gets"""
    layers: tuple[int, int]
    """[start, end) of that stage's layers"""
    state: str
    """waiting, checking, sending, verifying, done or failed"""
    found: str
    """what the node held: present, missing or mismatch; "" before it was checked"""
    tensors_needed: int = Field(ge=0)
    """tensors it lacked"""
    bytes_total: int = Field(ge=0)
    """bytes of the tensors it lacked"""
    bytes_resumed: int = Field(ge=0)
    """of those, bytes already on the node from an interrupted try (not sent again)"""
    bytes_sent: int = Field(ge=0)
    """bytes sent to it so far"""
    stage_bytes: int = Field(ge=0)
    """bytes of every tensor the stage needs (what a full copy would send)"""
    rate_bytes_s: float
    """bytes per second sent so far"""
    eta_s: float | None
    """seconds left at that rate; null unless it is sending"""
    error: str | None
    """why it failed; null unless it did"""


class PrepareStatus(StatusModel):
    """The last ``mlxppctl prepare`` (or the agent's own at start)."""

    state: Literal["running", "done", "failed"]
    """running; done: every node holds the cluster's copy; failed: a node did not"""
    reason: str
    """who started it: operator, or the agent's reason (auto: ...)"""
    started_at: float
    """wall clock when it started, Unix seconds"""
    max_rate_bytes_s: float | None
    """the cap on bytes per second sent to each node; null: none"""
    nodes: tuple[PrepareNodeProgress, ...]
    """each node being prepared"""


class NamedAdapter(StatusModel):
    """One per-request LoRA adapter (docs/adapters.md)."""

    path: str
    """its directory, on every stage host"""
    running: int = Field(ge=0)
    """requests using it now"""


class AdapterStatus(StatusModel):
    """The adapters the pipeline holds."""

    fused: str | None
    """the adapter directory fused into every stage's weights; null: none"""
    named: dict[str, NamedAdapter]
    """the adapters a request may choose, by the name it sends as model"""


class RepartitionEventRecord(StatusModel):
    """One transition of an elastic repartition (docs/elastic.md)."""

    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True)

    seq: int | MISSING = Field(MISSING, ge=0)
    """its number, counting from 0 (in the events list; not with the last event)"""
    trigger: Trigger
    """what started the repartition"""
    from_: ElasticState = Field(alias="from")
    """the state left"""
    to: ElasticState
    """the state entered"""
    outcome: Outcome
    """progress, or how the repartition ended: completed, aborted or failed"""
    ranges_before: str
    """the inclusive layer ranges in force before, e.g. 0-14,15-29"""
    ranges_after: str | None
    """the new ranges once planned; null before"""
    at: float
    """clock time of the transition, seconds"""
    phase_s: float
    """seconds spent in the state left"""
    total_s: float
    """seconds since the trigger was accepted"""
    detail: str
    """what happened, in a sentence ("" when nothing to say)"""


class RepartitionEvents(StatusModel):
    """``GET /admin/v1/repartition/events``: the events numbered above ``after``."""

    state: ElasticState
    """the elastic state now"""
    events: tuple[RepartitionEventRecord, ...]
    """the events, oldest first, each with its seq"""


class CoordinatorStatus(StatusModel):
    """The coordinator: whether it serves, its admission and what it last did."""

    node_id: str
    """the coordinator's node id"""
    http_address: str
    """host:port of its HTTP API; "" before it listens"""
    ready: bool
    """the pipeline can serve"""
    detail: str
    """why it cannot serve, or that every stage is connected"""
    admission: Literal["open", "draining"]
    """whether new requests are admitted"""
    in_flight: int = Field(ge=0)
    """requests generating now"""
    waiting: int = Field(ge=0)
    """requests queued for a slot"""
    transport: str | None
    """the backend of its links to the stages (tcp, thunderbolt, rdma); null when down"""
    config_generation: str
    """the configuration it runs"""
    last_reload_error: str | None
    """why its last configuration reload failed; null: none failed"""
    elastic_state: ElasticState
    """idle unless an elastic repartition is under way"""
    reload_failures: int = Field(ge=0)
    """configuration reloads that failed since it started"""
    failovers: tuple[FailoverRecord, ...]
    """its recent lost stages, oldest first"""
    warnings: tuple[str, ...]
    """the pre-launch warnings of its plan, one sentence each"""
    prepare: PrepareStatus | None
    """the last prepare; null when none ran"""
    adapters: AdapterStatus | MISSING = MISSING
    """the LoRA adapters; left out when the pipeline has no adapter registry"""
    elastic_enabled: bool | MISSING = MISSING
    """elastic repartitioning is on; left out without an elastic driver"""
    last_repartition_event: RepartitionEventRecord | None | MISSING = MISSING
    """the last repartition transition (null: none yet); left out without an elastic driver"""
    last_repartition_loads: tuple[LayerLoad | None, ...] | MISSING = MISSING
    """what each stage read at the last repartition's prepare (null: a stage that said
    nothing); left out without an elastic driver"""


class ClusterStatus(StatusModel):
    """What the coordinator's runtime reports; the admin API adds the health badge."""

    cluster: str
    """the cluster's [cluster] name"""
    coordinator: CoordinatorStatus
    """the coordinator"""
    stages: tuple[StageCard, ...]
    """the pipeline as it serves now, in stage order (after a failover, the rebuilt chain)"""
    standbys: tuple[NodeCard, ...]
    """the file's standby nodes, idle or serving a lost stage's layers"""


class StatusDocument(ClusterStatus):
    """``GET /admin/v1/status``: the cluster's status with its health badge."""

    health: HealthBadge
    """healthy, degraded (serving, but look) or unhealthy (not serving)"""
    detail: str
    """the first problem found, or that every stage is connected"""
