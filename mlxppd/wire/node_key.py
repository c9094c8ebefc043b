"""A node's own long-term X25519 key: where it is looked up, how it is read and made.

The file holds the 32 private bytes as 44 characters of base64 and a newline (WireGuard's
form); it follows the secret's file rules (``core/config/private_file.py``: no symbolic link,
mode 600, owned by the reader or root). Its public half goes into the cluster TOML's
``[roster]`` (``core/config/roster.py``); ``mlxppctl node-key new PATH`` writes a key and
prints that line.

Lookup order: ``--node-key-file``, then ``MLXPP_NODE_KEY_FILE``, then ``node_key_file`` in
``mlxppd.toml``, then ``node.key`` in the config directory. The private bytes never appear in
a repr, an error or a log line.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from mlxppd.core.config.private_file import allow_loose_from, read_private_file, write_private_file
from mlxppd.core.config.roster import (
    ROSTER_KEY,
    Roster,
    public_key_text,
    roster_line,
    roster_missing_hint,
)
from mlxppd.core.errors import ConfigurationError

__all__ = [
    "DEFAULT_NODE_KEY_NAME",
    "ENV_NODE_KEY_FILE",
    "NODE_KEY_FLAG",
    "NodeKey",
    "check_own_key",
    "load_node_key",
    "resolve_node_key_path",
    "save_node_key",
    "write_new_node_key",
]

ENV_NODE_KEY_FILE = "MLXPP_NODE_KEY_FILE"
NODE_KEY_FLAG = "--node-key-file"
HOST_KEY = "node_key_file in mlxppd.toml"
DEFAULT_NODE_KEY_NAME = "node.key"
_WHAT = "the node key file"


class NodeKey:
    """This node's X25519 private key; repr and str never show it."""

    __slots__ = ("_private", "origin", "public")

    def __init__(self, private: X25519PrivateKey, origin: str):
        self._private = private
        #: the 32 public bytes, as the roster lists them
        self.public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.origin = origin

    @classmethod
    def generate(cls, origin: str = "generated") -> NodeKey:
        return cls(X25519PrivateKey.generate(), origin)

    @classmethod
    def from_private_bytes(cls, raw: bytes, origin: str) -> NodeKey:
        return cls(X25519PrivateKey.from_private_bytes(raw), origin)

    def exchange(self, peer_public: bytes) -> bytes:
        """X25519 with a peer's public key (the handshake's ``s`` tokens)."""
        return self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))

    def file_text(self) -> str:
        """The key file's content: base64 of the private bytes, newline-terminated."""
        raw = self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return base64.b64encode(raw).decode() + "\n"

    @property
    def public_text(self) -> str:
        return public_key_text(self.public)

    def __repr__(self) -> str:
        return f"NodeKey(public={self.public_text}, origin={self.origin!r}, private redacted)"

    __str__ = __repr__

    def __reduce__(self) -> str:
        raise TypeError("a NodeKey is never serialized")


def resolve_node_key_path(
    *,
    flag_path: str | os.PathLike[str] | None,
    environ: Mapping[str, str],
    config_value: str | None,
    config_dir: Path | None,
) -> tuple[Path, str] | None:
    """(path, where it was named) of the first configured source in lookup order (pure)."""
    if flag_path:
        return Path(flag_path).expanduser(), NODE_KEY_FLAG
    if environ.get(ENV_NODE_KEY_FILE):
        return Path(environ[ENV_NODE_KEY_FILE]).expanduser(), ENV_NODE_KEY_FILE
    if config_value:
        path = Path(config_value).expanduser()
        if not path.is_absolute() and config_dir is not None:
            path = config_dir / path
        return path, HOST_KEY
    if config_dir is not None:
        return config_dir / DEFAULT_NODE_KEY_NAME, f"the default {DEFAULT_NODE_KEY_NAME}"
    return None


def _parse(raw: bytes, where: str) -> bytes:
    text = raw.strip()
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != 32:
        raise ConfigurationError(
            f"{where} does not hold a node key (44 characters of base64); write one with "
            "`mlxppctl node-key new PATH`"
        )
    return key


def load_node_key(
    node_id: str,
    *,
    flag_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    config_value: str | None = None,
    config_dir: Path | None = None,
    allow_loose: bool | None = None,
) -> NodeKey:
    """Find and read this node's key; missing or malformed is one ConfigurationError naming
    the file and the command that makes one."""
    environ = os.environ if environ is None else environ
    found = resolve_node_key_path(
        flag_path=flag_path, environ=environ, config_value=config_value, config_dir=config_dir
    )
    if found is None:
        raise ConfigurationError(
            f"node {node_id} has no node key; pass {NODE_KEY_FLAG} PATH (or set "
            f"{ENV_NODE_KEY_FILE}), and {roster_missing_hint(node_id)}"
        )
    path, named_by = found
    if named_by.startswith("the default") and not path.exists():
        raise ConfigurationError(
            f"node {node_id} has no node key ({path} does not exist); "
            f"{roster_missing_hint(node_id).replace('/etc/mlxpp/node.key', str(path))}"
        )
    raw = read_private_file(
        path,
        what=_WHAT,
        named_by=named_by,
        allow_loose=allow_loose_from(environ) if allow_loose is None else allow_loose,
        hint=f"write one with `mlxppctl node-key new {path}`",
    )
    return NodeKey.from_private_bytes(_parse(raw, f"{_WHAT} {path}"), f"{named_by} ({path})")


def check_own_key(roster: Roster, node_id: str, key: NodeKey, *, source: str) -> None:
    """Refuse to start a node whose key is not the one the roster lists for it: its every
    handshake would fail, so say so once, at start."""
    if not len(roster):
        raise ConfigurationError(
            f"the cluster TOML lists no node keys ({ROSTER_KEY} is missing or empty), and every "
            f"node now proves its id with a key of its own; {roster_missing_hint(node_id)}",
            source=source,
        )
    listed = roster.key_of(node_id)
    if listed is None:
        raise ConfigurationError(
            f"node {node_id} is not in {ROSTER_KEY}; add the line "
            f"{roster_line(node_id, key.public_text)} (this host's key, from {key.origin}) or, "
            "if the node was removed on purpose, do not start it",
            source=source,
            key=f"roster.{node_id}",
        )
    if listed != key.public:
        raise ConfigurationError(
            f"{key.origin} is not node {node_id}'s key: {ROSTER_KEY} lists "
            f"{public_key_text(listed)}, this key's public half is {key.public_text}; use the "
            f"node's own key file, or put this public key in {ROSTER_KEY}",
            source=source,
            key=f"roster.{node_id}",
        )


def write_new_node_key(path: Path, *, force: bool = False) -> NodeKey:
    """A fresh key written to ``path`` (mode 0600); an existing file needs ``force``."""
    key = NodeKey.generate(str(path))
    save_node_key(key, path, force=force)
    return key


def save_node_key(key: NodeKey, path: Path, *, force: bool = False) -> None:
    """Write ``key`` to ``path`` (mode 0600); an existing file needs ``force``."""
    write_private_file(
        path,
        key.file_text().encode(),
        what=_WHAT,
        force=force,
        replaced="the node's line in [roster] then needs the new public key",
    )
