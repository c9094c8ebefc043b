"""Node roles of the cluster TOML: the values, the spellings accepted for them, and the field
that reads them (output always uses the canonical value)."""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BeforeValidator, WithJsonSchema

__all__ = ["NodeRole", "RoleField"]


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
