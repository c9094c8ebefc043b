"""The cluster TOML: pydantic models, their invariants, and loading with readable errors.

Its parts live beside it: ``nodes`` (one ``[[nodes]]`` entry), ``roles`` (node roles and their
spellings), ``topology`` (the cross-node invariants), ``roster`` (node and operator keys);
text-level helpers ``addresses`` (host:port), ``messages`` (error wording) and ``render`` (the
TOML text, which imports this module; this one never imports it).

One file describes the whole cluster: ``[cluster]`` (sizes, transport, secret, elastic and
failover policies, optional layer ranges) and one ``[[nodes]]`` entry per process. Every
invariant the runtime relies on is checked here (or by a part it calls), so later layers can
trust a ``ClusterConfig`` without re-checking it.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from mlxppd.core.config.adapters import AdapterEntry, adapter_names_problem
from mlxppd.core.config.addresses import parse_address
from mlxppd.core.config.failover import FailoverPolicy
from mlxppd.core.config.messages import KeyedValueError, validation_error
from mlxppd.core.config.names import NAME_SCHEMA, name_problem, suggested_name
from mlxppd.core.config.nodes import Node
from mlxppd.core.config.ports import (
    DEFAULT_TRANSPORT_PORT_RANGE,
    TransportPortRangeField,
    fill_node_ports,
)
from mlxppd.core.config.roles import NodeRole
from mlxppd.core.config.roster import Roster, parse_public_key
from mlxppd.core.config.topology import check_topology
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


#: ``grammar_compile_limit_s``: its default, and its ceiling (seconds), which keeps a refused
#: compile's reply well inside the coordinator's 30 s wait for an admission
DEFAULT_GRAMMAR_COMPILE_LIMIT_S = 5.0
MAX_GRAMMAR_COMPILE_LIMIT_S = 20.0


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
        check_topology(
            self.nodes, self.cluster.pipeline_parallel_size, self.cluster.tensor_parallel_size
        )
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
