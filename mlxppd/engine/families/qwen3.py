"""Qwen 3 dense (q/k norms live inside the block); the defaults run it as is."""

from __future__ import annotations

from mlxppd.engine.families.base import Family

FAMILY = Family()
