"""Validation errors as one sentence: the file, the key path, its line, and the fix."""

from __future__ import annotations

import difflib
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from mlxppd.core.errors import ConfigurationError

Loc = tuple[str | int, ...]


class KeyedValueError(ValueError):
    """A validation error that names the wrong key, relative to the model that raises it."""

    def __init__(self, key: Loc, message: str):
        super().__init__(message)
        self.key = key


# -- validation errors -----------------------------------------------------------------------


def format_key_path(loc: Loc) -> str:
    """("nodes", 1, "address") -> "nodes[1].address", the way a TOML reader names it."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _model_at(root: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The model class whose table sits at ``loc`` (for suggesting key names)."""
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = field.annotation
        # Unwrap list[X] and X | None down to the model class.
        while typing.get_origin(model) is not None:
            args = [a for a in typing.get_args(model) if a is not type(None)]
            model = args[0] if args else None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _key_lines(text: str) -> dict[Loc, int]:
    """Best-effort map from key path to 1-based line: table headers and `key =` lines."""
    lines: dict[Loc, int] = {}
    table: Loc = ()
    counts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if m := re.match(r"\[\[\s*([A-Za-z0-9_.\-]+)\s*\]\]", line):
            name = m.group(1)
            counts[name] = counts.get(name, -1) + 1
            lines.setdefault(tuple(name.split(".")), number)
            table = (*name.split("."), counts[name])
        elif m := re.match(r"\[\s*([A-Za-z0-9_.\-]+)\s*\]", line):
            table = tuple(m.group(1).split("."))
        elif m := re.match(r"([A-Za-z0-9_.\-]+)\s*=", line):
            lines.setdefault((*table, *m.group(1).split(".")), number)
            continue
        else:
            continue
        lines.setdefault(table, number)
    return lines


def _line_of(loc: Loc, lines: dict[Loc, int]) -> int | None:
    # A missing key has no line of its own: fall back to the table that should hold it.
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


_TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
_EXPECTED = {
    "bool_type": "a boolean (true or false)",
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "an array",
    "model_type": "a table",
    "dict_type": "a table",
}
_BOUNDS = {
    "greater_than_equal": "at least",
    "greater_than": "above",
    "less_than_equal": "at most",
    "less_than": "below",
}


def _toml_type(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return _TOML_TYPES.get(type(value), type(value).__name__)


def _describe(root: type[BaseModel], error: Any) -> tuple[Loc, str]:
    """Turn one pydantic error into (full key path, sentence with the fix)."""
    loc: Loc = tuple(error["loc"])
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    cause = ctx.get("error")
    if isinstance(cause, KeyedValueError):
        return (*loc, *cause.key), str(cause)
    if isinstance(cause, ValueError):
        return loc, str(cause)
    if kind == "extra_forbidden":
        key = str(loc[-1])
        model = _model_at(root, loc[:-1])
        known = list(model.model_fields) if model else []
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
        return loc, f"unknown key '{key}'; {hint}"
    if kind == "missing":
        model = _model_at(root, loc)
        if len(loc) == 1 and model is not None:
            field = root.model_fields[str(loc[0])]
            if typing.get_origin(field.annotation) is list:
                return loc, f"required key missing; add a [[{loc[0]}]] table for each entry"
            return loc, f"required key missing; add a [{loc[0]}] table"
        return loc, f"required key missing; add {loc[-1]} = ..."
    if kind in _EXPECTED:
        got = f"{_toml_type(value)} {value!r}"
        return loc, f"expected {_EXPECTED[kind]}, got {got}; change the value"
    if kind in _BOUNDS:
        limit = next(iter(ctx.values()))
        return loc, f"{value!r} is out of range; use a value {_BOUNDS[kind]} {limit}"
    if kind in ("too_short", "string_too_short"):
        return loc, "must not be empty; give a value or remove the key"
    message = str(error["msg"])
    return loc, message[:1].lower() + message[1:]


def validation_error(
    exc: ValidationError, root: type[BaseModel], text: str, source: str
) -> ConfigurationError:
    """One ConfigurationError for all of ``exc``: the first problem with its key path and line,
    then the others briefly."""
    # An unknown key usually explains a missing one (a typo), so it is reported first.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    problems = [_describe(root, e) for e in errors]
    loc, message = problems[0]
    line = _line_of(loc, _key_lines(text))
    if line is not None:
        message += f" (line {line})"
    if len(problems) > 1:
        rest = "; ".join(f"{format_key_path(k) or 'top level'}: {m}" for k, m in problems[1:6])
        more = f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
        message += f"; also {rest}{more}"
    return ConfigurationError(message, source=source, key=format_key_path(loc) or None)
