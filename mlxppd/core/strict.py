"""The base of mlxpp's pydantic models: frozen, and an unknown field is an error, not ignored."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictModel"]


class StrictModel(BaseModel):
    """Config sections, messages and settings: a typo'd or foreign key is refused by name."""

    model_config = ConfigDict(extra="forbid", frozen=True)
