"""Control messages that change a stage's per-request adapters while it serves."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from mlxppd.core.strict import StrictModel

__all__ = ["AdapterLoad", "AdapterName", "AdapterReply", "AdapterUnload"]

AdapterName = Annotated[
    str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
]
Rid = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Count = Annotated[int, Field(ge=0, le=1 << 40)]


class AdapterLoad(StrictModel):
    """Hold adapter ``name`` from ``path`` on this stage's layers (its own tensors only)."""

    op: Literal["adapter_load"] = "adapter_load"
    rid: Rid = 0
    name: AdapterName
    path: str = Field(min_length=1, max_length=4096, description="the directory on this host")


class AdapterUnload(StrictModel):
    """Drop adapter ``name`` (the coordinator has drained its requests)."""

    op: Literal["adapter_unload"] = "adapter_unload"
    rid: Rid = 0
    name: AdapterName


class AdapterReply(StrictModel):
    rid: Rid = 0
    ok: bool = True
    error: str | None = Field(None, max_length=2000)
    digest: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    read: Count = 0
    """adapter tensors this stage read"""
    stored: Count = 0
    """adapter tensors in the file"""
    modules: Count = 0
