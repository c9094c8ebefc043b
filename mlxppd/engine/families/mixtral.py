"""Mixtral: sparse MoE blocks, otherwise llama-shaped; the defaults run it as is."""

from __future__ import annotations

from mlxppd.engine.families.base import Family

FAMILY = Family()
