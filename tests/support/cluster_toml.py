"""Cluster TOML texts for the config tests, and loading them through a real file.

``cluster_toml()`` is the default 2-stage cluster (``COORD`` and ``STAGES_2``); a test merges
cluster keys in or gives its own node tables. ``refused`` pins an error's whole shape:
``<file>: <key path>: <what is wrong>; <the fix>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxppd.core.config.cluster import ClusterConfig, load_cluster_config
from mlxppd.core.errors import ConfigurationError


def toml_value(v: Any) -> str:
    """``v`` written as a TOML value (strings quoted, booleans lower case, lists inline)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(v) if isinstance(v, str) else str(v)


def cluster_toml(
    cluster: dict[str, Any] | None = None, nodes: list[dict[str, Any]] | None = None
) -> str:
    """A cluster TOML: the default 2-stage cluster, with ``cluster`` keys merged in and ``nodes``
    replacing the node list when given (a value of None drops the key)."""
    table: Table = {"name": "test", "pipeline_parallel_size": 2}
    table.update(cluster or {})
    policies = {key: table.pop(key, None) for key in ("elastic", "failover")}
    lines = ["[cluster]"] + [f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None]
    for key, policy in policies.items():
        if policy is not None:
            lines += ["", f"[cluster.{key}]"] + [
                f"{k} = {toml_value(v)}" for k, v in policy.items()
            ]
    for node in STAGES_2 if nodes is None else nodes:
        lines += ["", "[[nodes]]"] + [
            f"{k} = {toml_value(v)}" for k, v in node.items() if v is not None
        ]
    return "\n".join(lines) + "\n"


Table = dict[str, Any]
COORD: Table = {"id": "coord", "address": "10.0.0.1:19000", "role": "hybrid"}
STAGES_2: list[Table] = [
    COORD,
    {"id": "a", "address": "10.0.0.2:19001", "role": "pipeline_stage", "stage": 0},
    {"id": "b", "address": "10.0.0.3:19001", "role": "pipeline_stage", "stage": 1},
]


def grid_nodes(
    pp: int = 2, tp: int = 2, role: str = "pipeline_tensor_parallel"
) -> list[dict[str, Any]]:
    """``COORD`` and a ``pp`` x ``tp`` grid of nodes ``s<stage>-r<rank>`` of ``role``."""
    nodes: list[Table] = [COORD]
    for s in range(pp):
        for r in range(tp):
            address = f"10.0.{s + 1}.{r + 1}:8080"
            nodes.append(
                {"id": f"s{s}-r{r}", "address": address, "role": role, "stage": s, "rank": r}
            )
    return nodes


def load_text(tmp_path: Path, text: str) -> ClusterConfig:
    """``text`` loaded from a real file, as ``mlxppd`` loads a cluster TOML."""
    path = tmp_path / "cluster.toml"
    path.write_text(text, encoding="utf-8")
    return load_cluster_config(path)


def refused(tmp_path: Path, text: str, key: str | None, *fragments: str) -> str:
    """Load ``text`` from a file; it must be refused at ``key`` with every fragment in the
    message. Returns the message."""
    path = tmp_path / "cluster.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigurationError) as info:
        load_cluster_config(path)
    error = info.value
    message = str(error)
    assert error.source == str(path)
    assert message.startswith(f"{path}: ")
    assert error.key == key, message
    if key is not None:
        assert message.startswith(f"{path}: {key}: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message
