"""Request bodies that break exactly one rule of the API's own request models.

Each body is a valid request with one field (or one field of one message) replaced by a value
its JSON schema does not allow: another JSON type, a number past a bound, a string or a list
past its length, a word outside an enum. Derived from ``model_json_schema()``, so a field added
to ``mlxppd/http/requests.py`` is attacked without touching this file.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel

JSON_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")

_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "null": st.none(),
    "boolean": st.booleans(),
    "integer": st.integers(min_value=-(2**70), max_value=2**70),
    "number": st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)),
    "string": st.text(max_size=20),
    "array": st.lists(st.integers(), max_size=3),
    "object": st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
}


def _options(schema: dict[str, Any], defs: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives a property allows (``anyOf`` members, ``$ref`` resolved)."""
    if "$ref" in schema:
        return _options(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema:
        return [o for member in schema["anyOf"] for o in _options(member, defs)]
    return [schema]


def _allowed_types(options: list[dict[str, Any]]) -> set[str]:
    types = {o.get("type", "object") for o in options}
    if "number" in types:
        types.add("integer")  # JSON numbers: an integer is a number
    return types


def _past_bounds(option: dict[str, Any]) -> list[st.SearchStrategy[Any]]:
    """Values of the option's own type that break one of its bounds."""
    kind = option.get("type")
    out: list[st.SearchStrategy[Any]] = []
    if kind in ("integer", "number"):
        if "minimum" in option:
            out.append(st.integers(max_value=int(option["minimum"]) - 1, min_value=-(2**62)))
        if "exclusiveMinimum" in option:
            out.append(st.integers(max_value=int(option["exclusiveMinimum"]), min_value=-(2**62)))
        if "maximum" in option:
            out.append(st.integers(min_value=int(option["maximum"]) + 1, max_value=2**63))
    if kind == "string":
        if "maxLength" in option:
            n = option["maxLength"]
            out.append(st.text(min_size=n + 1, max_size=n + 8))
        if "enum" in option:
            out.append(st.text(max_size=12).filter(lambda s: s not in option["enum"]))
    if kind == "array":
        if "maxItems" in option:
            n = option["maxItems"]
            out.append(st.lists(st.just({}), min_size=n + 1, max_size=n + 1))
        if option.get("minItems", 0) > 0:
            out.append(st.just([]))
    return out


def invalid_values(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values a property's schema refuses: another JSON type, or past a bound."""
    options = _options(schema, defs)
    allowed = _allowed_types(options)
    wrong = [_VALUES[t] for t in JSON_TYPES if t not in allowed]
    bounded = [s for o in options for s in _past_bounds(o)] if len(options) == 1 else []
    return st.one_of(*wrong, *bounded)


def one_bad_field(model: type[BaseModel], valid: dict[str, Any]) -> st.SearchStrategy[dict]:
    """``valid`` with one of ``model``'s fields replaced by a value its schema refuses."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    fields = sorted(schema["properties"])
    return st.sampled_from(fields).flatmap(
        lambda name: invalid_values(schema["properties"][name], defs).map(
            lambda value: {**valid, name: value}
        )
    )


def one_bad_message(
    message_model: type[BaseModel], valid: dict[str, Any], message: dict[str, Any]
) -> st.SearchStrategy[dict]:
    """A chat body whose last message has one field its schema refuses (or misses one)."""
    schema = message_model.model_json_schema()
    defs = schema.get("$defs", {})
    bad = st.sampled_from(sorted(schema["properties"])).flatmap(
        lambda name: invalid_values(schema["properties"][name], defs).map(
            lambda value: {**message, name: value}
        )
    )
    missing = st.sampled_from(schema.get("required", [])).map(
        lambda name: {k: v for k, v in message.items() if k != name}
    )
    return st.one_of(bad, missing).map(lambda m: {**valid, "messages": [message, m]})
