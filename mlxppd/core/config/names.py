"""Node ids and the cluster name: one rule for both, since both travel in every handshake."""

from __future__ import annotations

import re

from pydantic import JsonValue

__all__ = ["MAX_NAME_CHARS", "NAME_SCHEMA", "name_problem", "suggested_name"]

_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
#: the handshake gives each name one length byte (mlxppd/wire/handshake.py)
MAX_NAME_CHARS = 255
#: the rule in the JSON schemas
NAME_SCHEMA: dict[str, JsonValue] = {"pattern": "^[A-Za-z0-9._-]+$", "maxLength": MAX_NAME_CHARS}


def name_problem(value: str, what: str) -> str | None:
    """Why ``value`` cannot be a node id or cluster name (``what`` says which), or None."""
    if not _NAME_RE.fullmatch(value) or len(value) > MAX_NAME_CHARS:
        shown = value if len(value) <= 40 else value[:40] + "..."
        return (
            f"{what} '{shown}' must be 1 to {MAX_NAME_CHARS} characters, only letters, digits, "
            "'.', '_' and '-'"
        )
    return None


def suggested_name(value: str, fallback: str) -> str:
    """``value`` with every run of other characters made one '-', cut to the limit."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", value).strip("-")[:MAX_NAME_CHARS]
    return name or fallback
