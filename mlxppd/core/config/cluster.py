"""The cluster TOML: pydantic models, their invariants, and loading with readable errors.

Text-level helpers live beside it: ``addresses`` (host:port), ``messages`` (error wording) and
``render`` (the TOML text, which imports this module; this one never imports it).

One file describes the whole cluster: ``[cluster]`` (sizes, transport, secret, elastic and
failover policies, optional layer ranges) and one ``[[nodes]]`` entry per process. Every
invariant the runtime relies on is checked here, so later layers can trust a ``ClusterConfig``
without re-checking it.
"""

from __future__ import annotations

import enum
import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from mlxppd.core.config.adapters import AdapterEntry, adapter_names_problem
from mlxppd.core.config.addresses import address_key, parse_address
from mlxppd.core.config.failover import FailoverPolicy
from mlxppd.core.config.messages import KeyedValueError, validation_error
from mlxppd.core.config.names import NAME_SCHEMA, name_problem, suggested_name
from mlxppd.core.config.ports import (
    DEFAULT_TRANSPORT_PORT_RANGE,
    TransportPortRangeField,
    fill_node_ports,
)
from mlxppd.core.config.roster import Roster, parse_public_key
from mlxppd.core.cpu_weights import CpuWeights, CpuWeightsField
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import LayerRange, check_layer_ranges, even_split, parse_layer_range
from mlxppd.core.strict import StrictModel as _Strict

__all__ = [
    "ClusterConfig",
    "ClusterSection",
    "ElasticPolicy",
    "FailoverPolicy",
    "Node",
    "NodeRole",
    "TransportBackend",
    "cluster_json_schema_text",
    "load_cluster_config",
    "parse_address",
    "parse_cluster_config",
]

TransportBackend = Literal["tcp", "thunderbolt", "rdma"]
Loc = tuple[str | int, ...]


class NodeRole(enum.StrEnum):
    """What a node does in the cluster."""

    #: serves the HTTP API and drives the stages, holding no layers; the TOML spells it
    #: "hybrid" (as other pipeline engines do) and accepts "coordinator"
    COORDINATOR = "hybrid"
    PIPELINE_STAGE = "pipeline_stage"
    PIPELINE_TENSOR_PARALLEL = "pipeline_tensor_parallel"
    #: runs an agent and holds the model files but serves no layers until the coordinator
    #: gives it a lost stage's; not counted in pipeline_parallel_size
    STANDBY = "standby"


#: ``grammar_compile_limit_s``: its default, and its ceiling (seconds), which keeps a refused
#: compile's reply well inside the coordinator's 30 s wait for an admission
DEFAULT_GRAMMAR_COMPILE_LIMIT_S = 5.0
MAX_GRAMMAR_COMPILE_LIMIT_S = 20.0

# Spellings accepted on input (aliases); output always uses the canonical value.
_ROLE_ALIASES = {
    "coordinator": NodeRole.COORDINATOR,
    "pp_tp": NodeRole.PIPELINE_TENSOR_PARALLEL,
    "2d": NodeRole.PIPELINE_TENSOR_PARALLEL,
}
_ROLE_INPUTS = [r.value for r in NodeRole] + list(_ROLE_ALIASES)


def _normalise_role(value: object) -> object:
    if isinstance(value, str) and not isinstance(value, NodeRole):
        role = _ROLE_ALIASES.get(value, value)
        if role not in _ROLE_INPUTS:
            choices = ", ".join(f"'{r}'" for r in _ROLE_INPUTS)
            raise ValueError(f"unknown role '{value}'; use one of {choices}")
        return NodeRole(role)
    return value


RoleField = Annotated[
    NodeRole,
    BeforeValidator(_normalise_role),
    # The schema lists the aliases too, so editors validating a TOML do not flag valid input.
    WithJsonSchema({"type": "string", "enum": _ROLE_INPUTS}),
]


class ElasticPolicy(_Strict):
    """``[cluster.elastic]``: opt-in elastic repartitioning (docs/elastic.md)."""

    enabled: bool = Field(
        False, strict=True, description="Enable elastic repartitioning (--enable-elastic-pp)."
    )
    drain_timeout_s: float = Field(
        120.0,
        gt=0,
        allow_inf_nan=False,
        strict=True,
        description="Seconds to wait for in-flight requests to finish before rebalancing.",
    )
    pressure_fraction: float = Field(
        0.92,
        gt=0,
        le=1,
        allow_inf_nan=False,
        strict=True,
        description="KV-cache fill fraction (0 < x <= 1) of a stage that triggers a repartition.",
    )
    cool_down_s: float = Field(
        30.0,
        ge=0,
        allow_inf_nan=False,
        strict=True,
        description="Seconds after a repartition before memory pressure may trigger another.",
    )


class ClusterSection(_Strict):
    """``[cluster]``: cluster-wide settings."""

    name: str = Field(
        "mlxpp-cluster",
        description="Cluster name (letters, digits, '.', '_', '-'; at most 255): sent in every "
        "handshake, scopes discovery beacons, and signed into admin requests.",
        json_schema_extra=NAME_SCHEMA,
    )
    pipeline_parallel_size: int = Field(
        ..., ge=2, strict=True, description="Number of pipeline stages (at least 2)."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        strict=True,
        description="Tensor-parallel ranks per stage; above 1 makes a 2D mesh.",
    )
    transport_backend: TransportBackend = Field(
        "tcp", description="Cross-stage transport: 'tcp', 'thunderbolt' or 'rdma'."
    )
    transport_port_range: TransportPortRangeField = Field(
        DEFAULT_TRANSPORT_PORT_RANGE,
        description='TCP ports, "FIRST-LAST" (both included, 1-65535), a node takes its '
        "transport port from when none is given (a local cluster's stages); open it in the "
        "firewall.",
    )
    secret_file: str | None = Field(
        None,
        min_length=1,
        description="Path of the cluster secret file; the last place the secret is looked up.",
    )
    rekey_after_records: int = Field(
        1 << 24,
        ge=1,
        le=1 << 40,
        strict=True,
        description="Records one direction of a stage link seals with one key before "
        "replacing it (forward secrecy within a long-lived link).",
    )
    rekey_after_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="Seconds a stage link uses one key at most before replacing it.",
    )
    elastic: ElasticPolicy = Field(
        default_factory=ElasticPolicy, description="Elastic repartitioning policy."
    )
    failover: FailoverPolicy = Field(
        default_factory=FailoverPolicy,
        description="Surviving the loss of a stage: heartbeats, reconnecting, standby nodes.",
    )
    layers: list[str] | None = Field(
        None,
        min_length=1,
        description='Inclusive layer range per stage, in stage order, e.g. ["0-14", "15-29"]; '
        "unset means the partitioner's plan for the model.",
    )
    kv_budget_bytes: int | None = Field(
        None,
        ge=1,
        description="KV cache budget of each stage in bytes; unset means no limit "
        "(--kv-budget-bytes overrides it).",
    )
    auto_prepare: bool = Field(
        True,
        description="At start, the coordinator ships the tensors a stage needs to stage nodes "
        "that hold no copy of the model (mlxppctl prepare does it on demand, and also repairs "
        "copies that differ).",
    )
    adapter: str | None = Field(
        None,
        min_length=1,
        description="A LoRA adapter directory fused into every stage's weights (each stage "
        "reads its own layers' tensors); the same path on every stage host.",
    )
    grammar_compile_limit_s: float = Field(
        DEFAULT_GRAMMAR_COMPILE_LIMIT_S,
        gt=0,
        le=MAX_GRAMMAR_COMPILE_LIMIT_S,
        allow_inf_nan=False,
        description="Seconds the last stage may take to compile one request's output schema "
        "(response_format, a forced tool call; 0 < x <= 20, under the coordinator's 30 s "
        "reply wait); a schema that takes longer is refused with a 400 naming this key.",
    )
    cpu_weights: CpuWeightsField = Field(
        CpuWeights.AUTO,
        description="How stages on CPU hosts hold their weights: float32 (materialized at "
        "load; fast on an optimized BLAS, 8x the memory of 4-bit), native, or auto (float32 "
        "where the host computes on the CPU with an optimized BLAS and it fits in memory).",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError('the cluster name is empty; set name = "my-cluster" or remove the key')
        problem = name_problem(value, "the cluster name")
        if problem is not None:
            raise ValueError(
                f"{problem}, since every node sends it in its handshake; rename it, "
                f'e.g. name = "{suggested_name(value, "my-cluster")}"'
            )
        return value

    @field_validator("layers")
    @classmethod
    def _layers_tile(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        ranges = []
        for i, text in enumerate(value):
            try:
                ranges.append(parse_layer_range(text))
            except ValueError as exc:
                raise KeyedValueError((i,), str(exc)) from None
        # The model's layer count is unknown here; the end is checked by layer_plan().
        check_layer_ranges(ranges)
        return [str(r) for r in ranges]  # canonical "a-b", so rendering is stable

    @model_validator(mode="after")
    def _layers_per_stage(self) -> ClusterSection:
        if self.layers is not None and len(self.layers) != self.pipeline_parallel_size:
            raise KeyedValueError(
                ("layers",),
                f"{len(self.layers)} layer ranges for pipeline_parallel_size = "
                f"{self.pipeline_parallel_size}; give exactly one range per stage",
            )
        return self

    def layer_ranges(self) -> tuple[LayerRange, ...] | None:
        """The ``layers`` key as half-open ranges, or None when unset."""
        if self.layers is None:
            return None
        return tuple(parse_layer_range(t) for t in self.layers)


class Node(_Strict):
    """``[[nodes]]``: one mlxppd process in the cluster."""

    id: str = Field(
        ...,
        description="Unique node id (letters, digits, '.', '_', '-'; at most 255); used by "
        "--node-id.",
        json_schema_extra=NAME_SCHEMA,
    )
    address: str = Field(
        ...,
        description="host:port other nodes connect to (IPv4, [IPv6]:port or hostname); "
        "without a port, the node's position in the file counted from the first port of "
        "[cluster] transport_port_range.",
    )
    role: RoleField = Field(
        ...,
        description="'hybrid' (the coordinator; alias 'coordinator'), 'pipeline_stage', "
        "'pipeline_tensor_parallel' (aliases 'pp_tp', '2d'), or 'standby' (no layers until "
        "the coordinator gives it a lost stage's).",
    )
    stage: int | None = Field(
        None, ge=0, strict=True, description="Pipeline stage index (0-based); stage nodes only."
    )
    rank: int | None = Field(
        None, ge=0, strict=True, description="Tensor-parallel rank (0-based); 2D nodes only."
    )
    tp_address: str | None = Field(
        None,
        description="host:port where this rank joins its stage's MLX ring (tensor-parallel "
        "collectives, unencrypted: a private link); 2D nodes only; default: address's host, "
        "the port after address's.",
    )

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        problem = name_problem(value, "node id")
        if problem is not None:
            raise ValueError(f'{problem}; rename it, e.g. id = "stage-0"')
        return value

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        parse_address(value)
        return value

    @property
    def host(self) -> str:
        """Host part of ``address`` (without IPv6 brackets)."""
        return parse_address(self.address)[0]

    @property
    def port(self) -> int:
        """Port part of ``address``."""
        return parse_address(self.address)[1]

    @field_validator("tp_address")
    @classmethod
    def _check_tp_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_address(value)
        return value

    @property
    def tp_rank(self) -> int:
        """Tensor-parallel rank, 0 for a node of a pipeline-only cluster."""
        return self.rank if self.rank is not None else 0

    @property
    def ring_address(self) -> str:
        """Where this rank joins its stage's ring (``tp_address``, or the port after
        ``address``'s on the same host)."""
        if self.tp_address is not None:
            return self.tp_address
        host, port = parse_address(self.address)
        return f"[{host}]:{port + 1}" if ":" in host else f"{host}:{port + 1}"


class ClusterConfig(_Strict):
    """A whole cluster TOML file."""

    cluster: ClusterSection = Field(..., description="Cluster-wide settings.")
    nodes: list[Node] = Field(
        ...,
        description="Every node: one hybrid coordinator, one node per (stage, rank), and any "
        "standby nodes.",
    )
    adapters: list[AdapterEntry] = Field(
        default_factory=list,
        max_length=64,
        description="LoRA adapters served beside the base model, each chosen by a request's "
        "model (mlxppctl adapter load|unload changes the set while serving).",
    )
    roster: dict[str, str] = Field(
        default_factory=dict,
        max_length=1024,
        description='Node id = "public key" (base64, from `mlxppctl node-key new`): the key '
        "each node proves in its handshake; a node not listed is refused.",
    )
    operators: dict[str, str] = Field(
        default_factory=dict,
        max_length=256,
        description='Operator name = "Ed25519 public key" (base64, from `mlxppctl operator-key '
        "new`): the keys admin requests may be signed with; when set, the cluster secret "
        "signs none.",
    )

    @field_validator("roster", "operators")
    @classmethod
    def _check_keys(cls, value: dict[str, str]) -> dict[str, str]:
        seen: dict[bytes, str] = {}
        for name, text in value.items():
            problem = name_problem(name, "the name")
            if problem is not None:
                raise KeyedValueError((name,), problem)
            try:
                raw = parse_public_key(text)
            except ValueError as exc:
                raise KeyedValueError((name,), str(exc)) from None
            if raw in seen:
                raise KeyedValueError(
                    (name,),
                    f"the same public key as {seen[raw]}; each needs a key of its own",
                )
            seen[raw] = name
        return value

    @property
    def node_roster(self) -> Roster:
        """``[roster]`` as a value the handshake checks keys against."""
        return Roster.from_table(self.roster)

    @model_validator(mode="before")
    @classmethod
    def _ports_from_the_range(cls, data: Any) -> Any:
        # An address without a port takes one from [cluster] transport_port_range.
        if isinstance(data, dict) and "nodes" in data and isinstance(data.get("cluster", {}), dict):
            section = data.get("cluster", {})
            ports = fill_node_ports(data.get("nodes"), section.get("transport_port_range"))
            return {**data, "nodes": ports}
        return data

    @model_validator(mode="after")
    def _topology_is_valid(self) -> ClusterConfig:
        _check_topology(self)
        problem = adapter_names_problem(self.adapters)
        if problem is not None:
            raise KeyedValueError(("adapters",), problem)
        if self.cluster.tensor_parallel_size > 1 and (self.adapters or self.cluster.adapter):
            raise KeyedValueError(
                ("adapters",) if self.adapters else ("cluster", "adapter"),
                "adapters run on stages of one rank; drop them or set tensor_parallel_size = 1",
            )
        return self

    @property
    def coordinator(self) -> Node:
        """The hybrid node (exactly one per cluster)."""
        return next(n for n in self.nodes if n.role is NodeRole.COORDINATOR)

    def stage_nodes(self) -> list[Node]:
        """Every node of a stage (not the coordinator, not a standby), by (stage, rank)."""
        serving = (NodeRole.COORDINATOR, NodeRole.STANDBY)
        stages = [n for n in self.nodes if n.role not in serving]
        return sorted(stages, key=lambda n: (n.stage, n.tp_rank))

    def standby_nodes(self) -> list[Node]:
        """The standby nodes, in the file's order."""
        return [n for n in self.nodes if n.role is NodeRole.STANDBY]

    def nodes_at_stage(self, stage: int) -> list[Node]:
        """The nodes of one pipeline stage, ordered by rank (one node when not 2D)."""
        return [n for n in self.stage_nodes() if n.stage == stage]

    def nodes_at_rank(self, rank: int) -> list[Node]:
        """The nodes of one tensor-parallel rank, ordered by stage (rank 0 = all when not 2D)."""
        return [n for n in self.stage_nodes() if n.tp_rank == rank]

    def pipeline_nodes(self) -> list[Node]:
        """One node per stage, in stage order: the one the pipeline talks to (rank 0 of a
        tensor-parallel stage; every stage node when not 2D)."""
        return self.nodes_at_rank(0)

    def find_node(self, node_id: str) -> Node | None:
        """The node with this id, or None."""
        return next((n for n in self.nodes if n.id == node_id), None)

    def layer_plan(self, num_layers: int) -> tuple[LayerRange, ...]:
        """Layer range per stage for ``num_layers``: ``cluster.layers`` or an even split."""
        ranges = self.cluster.layer_ranges()
        if ranges is None:
            return even_split(num_layers, self.cluster.pipeline_parallel_size)
        try:
            check_layer_ranges(ranges, num_layers)
        except ValueError as exc:
            raise ConfigurationError(str(exc), key="cluster.layers") from None
        return ranges


def _check_topology(cfg: ClusterConfig) -> None:
    """Every cross-node invariant; raises KeyedValueError at the first problem, in node order."""
    pp = cfg.cluster.pipeline_parallel_size
    tp = cfg.cluster.tensor_parallel_size
    seen_ids: dict[str, int] = {}
    seen_addresses: dict[tuple[str, int], int] = {}
    coordinators: list[int] = []
    slots: dict[tuple[int, int], int] = {}
    for i, node in enumerate(cfg.nodes):
        _check_unique(cfg, i, seen_ids, seen_addresses)
        if node.role in (NodeRole.COORDINATOR, NodeRole.STANDBY):
            _check_stageless(cfg, i, coordinators)
            continue
        slot = _stage_slot(node, i, pp, tp)
        if slot in slots:
            other = cfg.nodes[slots[slot]].id
            key = "stage" if tp == 1 else "rank"
            where = f"stage {node.stage}" if tp == 1 else f"(stage {slot[0]}, rank {slot[1]})"
            what = "each stage" if tp == 1 else "each (stage, rank) pair"
            raise KeyedValueError(
                ("nodes", i, key),
                f"{where} appears on nodes '{other}' and '{node.id}'; give {what} exactly one node",
            )
        slots[slot] = i
    if tp > 1:
        _check_rings(cfg)
    if not coordinators:
        raise KeyedValueError(
            ("nodes",),
            "no node has role 'hybrid'; add one coordinator node with role = \"hybrid\"",
        )
    _check_complete(slots, pp, tp)


def _check_rings(cfg: ClusterConfig) -> None:
    """Every rank's ring address is its own: no other rank's, no node's transport address."""
    taken = {address_key(n.address): n.id for n in cfg.nodes}
    for i, node in enumerate(cfg.nodes):
        if node.role is not NodeRole.PIPELINE_TENSOR_PARALLEL:
            continue
        if node.tp_address is None and node.port == 65535:
            raise KeyedValueError(
                ("nodes", i, "tp_address"),
                f"node '{node.id}' listens on port 65535, so there is no port after it for its "
                "tensor-parallel ring; set tp_address to a free host:port",
            )
        canon = address_key(node.ring_address)
        if canon in taken:
            how = "its tp_address" if node.tp_address else "the port after its address"
            raise KeyedValueError(
                ("nodes", i, "tp_address"),
                f"node '{node.id}' would join its tensor-parallel ring on {node.ring_address} "
                f"({how}), which node '{taken[canon]}' uses already; set tp_address to a free "
                "host:port",
            )
        taken[canon] = node.id


def _check_unique(
    cfg: ClusterConfig,
    i: int,
    seen_ids: dict[str, int],
    seen_addresses: dict[tuple[str, int], int],
) -> None:
    """Node ``i``'s id and address are not used by an earlier node (records them)."""
    node = cfg.nodes[i]
    if node.id in seen_ids:
        raise KeyedValueError(
            ("nodes", i, "id"),
            f"node id '{node.id}' is used by nodes[{seen_ids[node.id]}] and nodes[{i}]; "
            "give each node a unique id",
        )
    seen_ids[node.id] = i
    # Hostnames are case-insensitive; IPv6 spellings are compared in canonical form.
    canon = address_key(node.address)
    if canon in seen_addresses:
        other = cfg.nodes[seen_addresses[canon]].id
        raise KeyedValueError(
            ("nodes", i, "address"),
            f"address '{node.address}' is used by nodes '{other}' and '{node.id}'; "
            "give each node its own host:port",
        )
    seen_addresses[canon] = i


def _check_stageless(cfg: ClusterConfig, i: int, coordinators: list[int]) -> None:
    """The coordinator (one per cluster, recorded) or a standby: no stage or rank key."""
    node = cfg.nodes[i]
    if node.role is NodeRole.COORDINATOR and coordinators:
        other = cfg.nodes[coordinators[0]].id
        raise KeyedValueError(
            ("nodes", i, "role"),
            f"nodes '{other}' and '{node.id}' both have role 'hybrid'; a cluster has "
            "exactly one coordinator, so give the others role 'pipeline_stage'",
        )
    if node.role is NodeRole.COORDINATOR:
        coordinators.append(i)
        what = f"the coordinator '{node.id}' runs no stage"
    else:
        what = (
            f"node '{node.id}' is a standby, which serves no stage of its own until the "
            "coordinator gives it a lost stage's layers"
        )
    for key in ("stage", "rank", "tp_address"):
        if getattr(node, key) is not None:
            raise KeyedValueError(("nodes", i, key), f"{what}; remove its {key} key")


def _stage_slot(node: Node, i: int, pp: int, tp: int) -> tuple[int, int]:
    """The (stage, rank) a stage node fills, once its role, stage and rank are consistent."""
    name = f"'{node.id}'"
    if node.role is NodeRole.PIPELINE_TENSOR_PARALLEL and tp == 1:
        raise KeyedValueError(
            ("nodes", i, "role"),
            f"node {name} has role 'pipeline_tensor_parallel' but tensor_parallel_size is 1; "
            "set cluster.tensor_parallel_size above 1 or use role 'pipeline_stage'",
        )
    if node.role is NodeRole.PIPELINE_STAGE and tp > 1:
        raise KeyedValueError(
            ("nodes", i, "role"),
            f"node {name} has role 'pipeline_stage' but tensor_parallel_size is {tp}; "
            "in a 2D cluster every stage node has role 'pipeline_tensor_parallel' and a rank",
        )
    if node.stage is None:
        raise KeyedValueError(
            ("nodes", i, "stage"), f"node {name} has no stage; set stage to one of 0..{pp - 1}"
        )
    if node.stage >= pp:
        raise KeyedValueError(
            ("nodes", i, "stage"),
            f"node {name} has stage {node.stage} but pipeline_parallel_size is {pp}; "
            f"use a stage from 0 to {pp - 1}",
        )
    if tp == 1:
        if node.tp_address is not None:
            raise KeyedValueError(
                ("nodes", i, "tp_address"),
                f"node {name} has role 'pipeline_stage', which joins no tensor-parallel ring; "
                "remove tp_address, or set cluster.tensor_parallel_size for a 2D cluster",
            )
        if node.rank is not None:
            raise KeyedValueError(
                ("nodes", i, "rank"),
                f"node {name} has role 'pipeline_stage', which has no tensor-parallel rank; "
                "remove rank, or set cluster.tensor_parallel_size for a 2D cluster",
            )
        return node.stage, 0
    if node.rank is None:
        raise KeyedValueError(
            ("nodes", i, "rank"), f"node {name} has no rank; set rank to one of 0..{tp - 1}"
        )
    if node.rank >= tp:
        raise KeyedValueError(
            ("nodes", i, "rank"),
            f"node {name} has rank {node.rank} but tensor_parallel_size is {tp}; "
            f"use a rank from 0 to {tp - 1}",
        )
    return node.stage, node.rank


def _check_complete(slots: dict[tuple[int, int], int], pp: int, tp: int) -> None:
    """Every (stage, rank) of the pp x tp grid has its node."""
    missing = [(s, r) for s in range(pp) for r in range(tp) if (s, r) not in slots]
    if not missing:
        return
    if tp == 1:
        names = ", ".join(str(s) for s, _ in missing)
        subject = f"stage {names} has" if len(missing) == 1 else f"stages {names} have"
        raise KeyedValueError(
            ("nodes",),
            f"{subject} no node; pipeline_parallel_size = {pp} needs one "
            f"'pipeline_stage' node for each stage 0..{pp - 1}",
        )
    names = ", ".join(f"(stage {s}, rank {r})" for s, r in missing)
    raise KeyedValueError(
        ("nodes",),
        f"{len(slots)} 'pipeline_tensor_parallel' nodes but pipeline_parallel_size x "
        f"tensor_parallel_size = {pp * tp}; add nodes for {names}",
    )


def parse_cluster_config(text: str, source: str) -> ClusterConfig:
    """Parse cluster TOML ``text``; ``source`` names it (a path) in every error."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib puts the position in the message: "Invalid value (at line 2, column 5)".
        raise ConfigurationError(
            f"not valid TOML: {exc}; fix the syntax there", source=source
        ) from None
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, ClusterConfig, text, source) from None


def load_cluster_config(path: Path) -> ClusterConfig:
    """Read and validate the cluster TOML at ``path``."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the cluster TOML: {exc.strerror or exc}", source=str(path)
        ) from None
    except UnicodeDecodeError:
        raise ConfigurationError("the cluster TOML is not UTF-8 text", source=str(path)) from None
    return parse_cluster_config(text, str(path))


def cluster_json_schema_text() -> str:
    """The checked-in ``schemas/cluster.schema.json`` text (sorted keys, indent 2)."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema"}
    schema.update(ClusterConfig.model_json_schema())
    return json.dumps(schema, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
