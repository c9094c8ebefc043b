"""The roster: which node id holds which public key (the cluster TOML's ``[roster]`` table).

Each node has its own X25519 key pair (``mlxppctl node-key new PATH``); the roster lists every
node id with its public key, written as 44 characters of standard base64 (WireGuard's form). A
handshake proves that a peer holds the private key of the node id it claims
(``wire/noise.py``), so a host can only be the node whose key file it holds. Removing a line
revokes that node: it is refused at its next handshake and its open links are closed.

Pure: the table in, a frozen value out; the files are read by ``wire/node_key.py``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from mlxppd.core.errors import ConfigurationError

__all__ = [
    "PUBLIC_KEY_BYTES",
    "ROSTER_KEY",
    "Roster",
    "parse_public_key",
    "public_key_text",
    "roster_line",
    "roster_missing_hint",
]

PUBLIC_KEY_BYTES = 32
#: the TOML table the roster lives in
ROSTER_KEY = "[roster]"
_BASE64 = re.compile(r"[A-Za-z0-9+/]{43}=")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def public_key_text(raw: bytes) -> str:
    """A public key as the roster writes it: standard base64, 44 characters."""
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ValueError(f"a public key is {PUBLIC_KEY_BYTES} bytes")
    return base64.b64encode(raw).decode()


def parse_public_key(text: str) -> bytes:
    """The 32 bytes of a roster entry; ValueError, in one sentence, when it is not one."""
    text = text.strip()
    if not _BASE64.fullmatch(text):
        raise ValueError(
            "a public key is 44 characters of base64 ending in '=', as `mlxppctl node-key new` "
            "prints it"
        )
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ValueError("a public key is not valid base64") from None


def roster_line(node_id: str, public_text: str) -> str:
    """The ``[roster]`` line of ``node_id``: its id bare where TOML allows, quoted where it
    holds a '.' (bare, ``host.lab = ...`` would be a nested table, not that node)."""
    key = node_id if _BARE_KEY.fullmatch(node_id) else json.dumps(node_id)
    return f'{key} = "{public_text}"'


def roster_missing_hint(node_id: str) -> str:
    """How to give ``node_id`` a key: the command and the TOML line (one sentence's tail)."""
    return (
        f"run `mlxppctl node-key new /etc/mlxpp/node.key` on node {node_id}'s host and add the "
        f"line it prints ({roster_line(node_id, '<public key>')}) under {ROSTER_KEY} in the "
        "cluster TOML"
    )


@dataclass(frozen=True)
class Roster:
    """Node id -> its 32-byte X25519 public key; frozen and hashable."""

    entries: tuple[tuple[str, bytes], ...] = ()
    #: ids whose key is taken unseen: a zero-config bring-up only, before any roster exists,
    #: where the cluster secret alone authenticates (its TOML then lists the keys it saw)
    any_key_for: frozenset[str] = frozenset()

    @classmethod
    def from_table(cls, table: Mapping[str, str], *, origin: str = "the cluster TOML") -> Roster:
        """A roster from ``[roster]``'s ``node id = "public key"`` lines; a bad line is a
        ConfigurationError naming it. Two nodes may not share a key (one host, two ids)."""
        entries: list[tuple[str, bytes]] = []
        owners: dict[bytes, str] = {}
        for node_id, text in table.items():
            key = f"roster.{node_id}"
            if not isinstance(text, str):
                raise ConfigurationError(f"{origin}: {key} must be a public key in quotes", key=key)
            try:
                raw = parse_public_key(text)
            except ValueError as exc:
                raise ConfigurationError(f"{origin}: {key}: {exc}", key=key) from None
            if raw in owners:
                raise ConfigurationError(
                    f"{origin}: {key} has the same public key as roster.{owners[raw]}; each node "
                    "needs a key of its own (`mlxppctl node-key new PATH` on each host)",
                    key=key,
                )
            owners[raw] = node_id
            entries.append((node_id, raw))
        return cls(tuple(sorted(entries)))

    @classmethod
    def of(cls, keys: Mapping[str, bytes]) -> Roster:
        return cls(tuple(sorted(keys.items())))

    @classmethod
    def trusting(cls, *node_ids: str) -> Roster:
        """A roster that takes whatever key ``node_ids`` prove (zero-config bring-up)."""
        return cls((), frozenset(node_ids))

    def key_of(self, node_id: str) -> bytes | None:
        """The public key ``node_id`` must prove it holds; None: the node is not listed."""
        for listed, key in self.entries:
            if listed == node_id:
                return key
        return None

    def node_ids(self) -> frozenset[str]:
        return frozenset(node_id for node_id, _ in self.entries)

    def holds(self, node_id: str, key: bytes) -> bool:
        """Whether ``node_id`` is listed with exactly ``key``."""
        return node_id in self.any_key_for or self.key_of(node_id) == key

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def as_table(self) -> dict[str, str]:
        """The ``[roster]`` table that parses back to this roster."""
        return {node_id: public_key_text(key) for node_id, key in self.entries}
