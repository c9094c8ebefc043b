"""Cluster TOML as text: node addresses, deterministic rendering, errors that point at keys.

Kept apart from the models in ``cluster_config`` so that neither file grows past a screenful
of concerns. This module imports no model at run time (the root model is passed in), which
lets ``cluster_config`` import it without a cycle.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
import typing
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from mlxppd.core.errors import ConfigurationError

if TYPE_CHECKING:
    from mlxppd.core.cluster_config import ClusterConfig, Node

__all__ = [
    "CLUSTER_TOML_HEADER",
    "KeyedValueError",
    "address_key",
    "format_key_path",
    "join_host_port",
    "parse_address",
    "render_cluster_toml",
    "split_host_port",
    "validation_error",
]

Loc = tuple[str | int, ...]

# Static on purpose (determinism: docs/zero-config.md): no hostname, pid or clock, so the same
# cluster always renders to the same bytes and the file can live in version control.
CLUSTER_TOML_HEADER = (
    "# mlxpp cluster configuration (JSON Schema: schemas/cluster.schema.json).\n"
    "# Rendered with keys and nodes in a fixed order: the same cluster always gives the same\n"
    "# bytes. Hand edits are fine; the next render restores the order.\n"
)


class KeyedValueError(ValueError):
    """A validation error that names the wrong key, relative to the model that raises it."""

    def __init__(self, key: Loc, message: str):
        super().__init__(message)
        self.key = key


_HOST_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_ADDRESS_FORM = (
    "'host:port' (e.g. '192.168.1.11:19001', '[fe80::1]:19001' or 'studio-a.local:19001')"
)


def parse_address(text: str) -> tuple[str, int]:
    """Split "host:port" (IPv4, [IPv6]:port or a hostname) into (host, port); ValueError if bad."""
    bad = f"address '{text}' is not of the form {_ADDRESS_FORM}"
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or not text[close + 1 :].startswith(":"):
            raise ValueError(bad)
        host, port_text = text[1:close], text[close + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"'{host}' in address '{text}' is not an IPv6 address; {bad}"
            ) from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"address '{text}' has no port; write it as {_ADDRESS_FORM}")
        if ":" in host:
            raise ValueError(f"put an IPv6 host in brackets, like '[{host}]:{port_text}'")
        if not host:
            raise ValueError(f"address '{text}' has no host; write it as {_ADDRESS_FORM}")
        if re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ValueError(f"'{host}' in address '{text}' is not an IPv4 address") from None
        elif len(host) > 253 or not all(_HOST_LABEL_RE.fullmatch(x) for x in host.split(".")):
            raise ValueError(f"'{host}' in address '{text}' is not a valid hostname; {bad}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"port '{port_text}' in address '{text}' must be a number from 1 to 65535")
    if host == "0.0.0.0" or (":" in host and ipaddress.IPv6Address(host).is_unspecified):
        # Peers connect to this address, so a wildcard bind address cannot work here.
        raise ValueError(f"address '{text}' is a wildcard; give the address other nodes connect to")
    return host, int(port_text)


def address_key(address: str) -> tuple[str, int]:
    """The identity of a node address, for telling two apart: hostnames are case-insensitive
    and IPv6 has one canonical spelling. ValueError as ``parse_address``."""
    host, port = parse_address(address)
    return (str(ipaddress.ip_address(host)) if ":" in host else host.lower(), port)


def split_host_port(text: str) -> tuple[str, int] | None:
    """(host, port) of a bind address, ``host:port`` or ``[v6]:port``; wildcards and port 0
    are allowed, and the host is not checked. None when ``text`` does not end in ``:digits``."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return (host[1:-1] if host.startswith("[") and host.endswith("]") else host), int(port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (the inverse of ``parse_address``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- rendering -------------------------------------------------------------------------------

_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _toml_str(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            # TOML forbids raw control characters in basic strings.
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        # repr is the shortest text that reads back as the same float, and always has '.' or 'e'.
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")


def _node_lines(node: Node) -> list[str]:
    lines = ["[[nodes]]"]
    # Fixed key order (id, address, role, stage, rank); unset keys are left out.
    for key in ("id", "address", "role", "stage", "rank"):
        value = getattr(node, key)
        if value is not None:
            lines.append(f"{key} = {_toml_value(str(value) if key == 'role' else value)}")
    return lines


def render_cluster_toml(cfg: ClusterConfig) -> str:
    """Render ``cfg`` as TOML, byte-identical for equal clusters whatever the node order.

    ``[cluster.elastic]`` is always written, with every key, so the file shows every knob.
    Nodes: the coordinator first, then stage nodes by (stage, rank).
    """
    c = cfg.cluster
    lines = [CLUSTER_TOML_HEADER.rstrip("\n"), "", "[cluster]"]
    lines.append(f"name = {_toml_value(c.name)}")
    lines.append(f"pipeline_parallel_size = {_toml_value(c.pipeline_parallel_size)}")
    lines.append(f"tensor_parallel_size = {_toml_value(c.tensor_parallel_size)}")
    lines.append(f"transport_backend = {_toml_value(c.transport_backend)}")
    if c.secret_file is not None:
        lines.append(f"secret_file = {_toml_value(c.secret_file)}")
    if c.layers is not None:
        lines.append(f"layers = {_toml_value(c.layers)}")
    if c.kv_budget_bytes is not None:
        lines.append(f"kv_budget_bytes = {c.kv_budget_bytes}")
    if c.cpu_weights != "auto":
        lines.append(f"cpu_weights = {_toml_value(str(c.cpu_weights))}")
    lines += ["", "[cluster.elastic]"]
    for key in ("enabled", "drain_timeout_s", "pressure_fraction", "cool_down_s"):
        lines.append(f"{key} = {_toml_value(getattr(c.elastic, key))}")
    for node in [cfg.coordinator, *cfg.stage_nodes()]:
        lines += ["", *_node_lines(node)]
    return "\n".join(lines) + "\n"


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
