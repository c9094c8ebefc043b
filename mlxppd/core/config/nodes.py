"""One ``[[nodes]]`` entry of the cluster TOML: a node's id, address, role and place (stage,
tensor-parallel rank, ring address), each checked on its own; what involves other nodes is
``topology.py``'s."""

from __future__ import annotations

from pydantic import Field, field_validator

from mlxppd.core.config.addresses import parse_address
from mlxppd.core.config.names import NAME_SCHEMA, name_problem
from mlxppd.core.config.roles import RoleField
from mlxppd.core.strict import StrictModel as _Strict

__all__ = ["Node"]


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
