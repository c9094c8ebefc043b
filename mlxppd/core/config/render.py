"""The cluster TOML rendered deterministically: the same cluster always gives the same bytes."""

from __future__ import annotations

from mlxppd.core.config.cluster import ClusterConfig, Node
from mlxppd.core.config.ports import DEFAULT_TRANSPORT_PORT_RANGE

# Static on purpose (determinism: docs/zero-config.md): no hostname, pid or clock, so the same
# cluster always renders to the same bytes and the file can live in version control.
CLUSTER_TOML_HEADER = (
    "# mlxpp cluster configuration (JSON Schema: schemas/cluster.schema.json).\n"
    "# Rendered with keys and nodes in a fixed order: the same cluster always gives the same\n"
    "# bytes. Hand edits are fine; the next render restores the order.\n"
)

_ELASTIC_KEYS = ("enabled", "drain_timeout_s", "pressure_fraction", "cool_down_s")
_FAILOVER_KEYS = (
    "enabled",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "reconnect_grace_s",
    "recovery_timeout_s",
    "restore_layout",
    "restore_after_s",
    "restore_drain_s",
)

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
    # Fixed key order (id, address, role, stage, rank, tp_address); unset keys are left out.
    for key in ("id", "address", "role", "stage", "rank", "tp_address"):
        value = getattr(node, key)
        if value is not None:
            lines.append(f"{key} = {_toml_value(str(value) if key == 'role' else value)}")
    return lines


def render_cluster_toml(cfg: ClusterConfig) -> str:
    """Render ``cfg`` as TOML, byte-identical for equal clusters whatever the node order.

    ``[cluster.elastic]`` and ``[cluster.failover]`` are always written, with every key, so
    the file shows every knob. Nodes: the coordinator first, then stage nodes by (stage, rank),
    then standby nodes in the file's order (the order the coordinator tries them in, so two
    files listing standbys in different orders describe different clusters).
    """
    c = cfg.cluster
    lines = [CLUSTER_TOML_HEADER.rstrip("\n"), "", "[cluster]"]
    lines.append(f"name = {_toml_value(c.name)}")
    lines.append(f"pipeline_parallel_size = {_toml_value(c.pipeline_parallel_size)}")
    lines.append(f"tensor_parallel_size = {_toml_value(c.tensor_parallel_size)}")
    lines.append(f"transport_backend = {_toml_value(c.transport_backend)}")
    if c.transport_port_range != DEFAULT_TRANSPORT_PORT_RANGE:
        lines.append(f"transport_port_range = {_toml_value(c.transport_port_range)}")
    if c.secret_file is not None:
        lines.append(f"secret_file = {_toml_value(c.secret_file)}")
    if c.layers is not None:
        lines.append(f"layers = {_toml_value(c.layers)}")
    if c.kv_budget_bytes is not None:
        lines.append(f"kv_budget_bytes = {c.kv_budget_bytes}")
    if c.cpu_weights != "auto":
        lines.append(f"cpu_weights = {_toml_value(str(c.cpu_weights))}")
    if c.adapter is not None:
        lines.append(f"adapter = {_toml_value(c.adapter)}")
    for key in ("rekey_after_records", "rekey_after_s"):
        if key in c.model_fields_set:
            lines.append(f"{key} = {_toml_value(getattr(c, key))}")
    lines += ["", "[cluster.elastic]"]
    for key in _ELASTIC_KEYS:
        lines.append(f"{key} = {_toml_value(getattr(c.elastic, key))}")
    lines += ["", "[cluster.failover]"]
    for key in _FAILOVER_KEYS:
        lines.append(f"{key} = {_toml_value(getattr(c.failover, key))}")
    for node in [cfg.coordinator, *cfg.stage_nodes(), *cfg.standby_nodes()]:
        lines += ["", *_node_lines(node)]
    for entry in cfg.adapters:
        lines += ["", "[[adapters]]", f"name = {_toml_value(entry.name)}"]
        lines.append(f"path = {_toml_value(entry.path)}")
    for table, keys in (("roster", cfg.roster), ("operators", cfg.operators)):
        if keys:
            lines += ["", f"[{table}]"]
            lines += [f"{_toml_value(name)} = {_toml_value(keys[name])}" for name in sorted(keys)]
    return "\n".join(lines) + "\n"
