"""``[[adapters]]`` in the cluster TOML: the LoRA adapters requests choose by name."""

from __future__ import annotations

from pydantic import Field, field_validator

from mlxppd.core.adapters import adapter_name_problem
from mlxppd.core.strict import StrictModel

__all__ = ["AdapterEntry", "adapter_names_problem"]


class AdapterEntry(StrictModel):
    """One per-request adapter: kept apart from the weights, chosen by a request's ``model``."""

    name: str = Field(
        ..., description="What clients send as the request's model to run this adapter."
    )
    path: str = Field(
        ...,
        min_length=1,
        description="The adapter directory (adapter_config.json + adapters.safetensors, or "
        "PEFT's adapter_model.safetensors); the same path on every stage host.",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        problem = adapter_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


def adapter_names_problem(entries: list[AdapterEntry]) -> str | None:
    """Why these entries cannot be served together (None: they can)."""
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            return f"two [[adapters]] are named {entry.name!r}; give each its own name"
        seen.add(entry.name)
    return None
