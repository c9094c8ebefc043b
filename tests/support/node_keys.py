"""Node keys for tests: one fixed key per node id, rosters that list them, key files.

Every test node's key is derived from its id, so two processes of one test agree on the
roster without passing keys around, and a test that needs an impostor makes a fresh key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from mlxppd.core.config.cluster import ClusterConfig
from mlxppd.core.config.roster import Roster
from mlxppd.wire.node_key import NodeKey, save_node_key

__all__ = [
    "AGENT_KEY_NAME",
    "add_roster",
    "node_key_for",
    "roster_for",
    "roster_toml",
    "with_roster",
    "without_roster_line",
    "write_agent_key",
    "write_node_keys",
]

#: the key file an agent reads from its config directory when nothing else names one
AGENT_KEY_NAME = "node.key"


def node_key_for(node_id: str) -> NodeKey:
    """The key test node ``node_id`` holds (the same in every process)."""
    raw = hashlib.sha256(b"mlxpp test node key\x00" + node_id.encode()).digest()
    return NodeKey.from_private_bytes(raw, f"test key of {node_id}")


def roster_for(node_ids: Iterable[str]) -> Roster:
    """A roster listing each of ``node_ids`` with its test key."""
    return Roster.of({n: node_key_for(n).public for n in node_ids})


def roster_toml(node_ids: Iterable[str]) -> str:
    """The ``[roster]`` table of ``node_ids``' test keys, as TOML text."""
    table = roster_for(node_ids).as_table()
    return "\n[roster]\n" + "".join(f'"{n}" = "{k}"\n' for n, k in table.items())


def with_roster(cluster: ClusterConfig, extra: Iterable[str] = ()) -> ClusterConfig:
    """``cluster`` with a roster of every node's test key (and of ``extra`` ids)."""
    ids = [n.id for n in cluster.nodes] + list(extra)
    data = cluster.model_dump(mode="json", exclude_unset=True)
    data["roster"] = roster_for(ids).as_table()
    return ClusterConfig.model_validate(data)


def add_roster(toml_path: Path, node_ids: Iterable[str]) -> None:
    """Append the ``[roster]`` of ``node_ids`` to the cluster TOML at ``toml_path``."""
    with toml_path.open("a", encoding="utf-8") as f:
        f.write(roster_toml(node_ids))


def write_node_keys(directory: Path, node_ids: Iterable[str]) -> dict[str, Path]:
    """Each node's test key written to ``directory/<id>.key`` (mode 0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for node_id in node_ids:
        path = directory / f"{node_id}.key"
        save_node_key(node_key_for(node_id), path, force=True)
        files[node_id] = path
    return files


def write_agent_key(config_dir: Path, node_id: str) -> Path:
    """Node ``node_id``'s test key as ``config_dir/node.key``, where an agent looks first."""
    path = config_dir / AGENT_KEY_NAME
    save_node_key(node_key_for(node_id), path, force=True)
    return path


def without_roster_line(toml_text: str, node_id: str) -> str:
    """``toml_text`` with ``node_id``'s line under ``[roster]`` removed (the node revoked)."""
    line = f'"{node_id}" = "{node_key_for(node_id).public_text}"\n'
    assert line in toml_text, f"{node_id} is not in the roster"
    return toml_text.replace(line, "")
