"""An operator's Ed25519 key, which signs admin requests, and the ``[operators]`` that list them.

An operator key is made on the operator's own machine (``mlxppctl operator-key new PATH``) and
never reaches a stage host: unlike the cluster secret, which every host holds, it lets only its
holder drain or repartition the cluster. The file is one line, ``NAME:BASE64`` (the operator's
name as ``[operators]`` lists it, then the 32 private bytes as 44 characters of base64), and
follows the secret's file rules (``core/config/private_file.py``: no symbolic link, mode 600,
owned by the reader or root). The same line, pasted into the web console's admin key field,
signs there. The private bytes never appear in a repr, an error or a log line.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from mlxppd.core.config.names import name_problem
from mlxppd.core.config.private_file import allow_loose_from, read_private_file, write_private_file
from mlxppd.core.config.roster import parse_public_key, public_key_text
from mlxppd.core.errors import ConfigurationError

__all__ = [
    "ENV_OPERATOR_KEY_FILE",
    "OPERATORS_KEY",
    "OPERATOR_KEY_FLAG",
    "SIGNATURE_BYTES",
    "OperatorKey",
    "Operators",
    "load_operator_key",
    "operators_of",
    "parse_operator_flags",
    "write_new_operator_key",
]

ENV_OPERATOR_KEY_FILE = "MLXPP_OPERATOR_KEY_FILE"
OPERATOR_KEY_FLAG = "--operator-key"
#: the cluster TOML's table of operator names and public keys
OPERATORS_KEY = "[operators]"
SIGNATURE_BYTES = 64
_WHAT = "the operator key file"
_HINT = "write one with `mlxppctl operator-key new PATH --name NAME`"


class OperatorKey:
    """An operator's name and Ed25519 private key; repr and str never show the key."""

    __slots__ = ("_private", "name", "origin", "public")

    def __init__(self, name: str, private: Ed25519PrivateKey, origin: str):
        problem = name_problem(name, "the operator name")
        if problem is not None:
            raise ValueError(problem)
        self.name = name
        self._private = private
        #: the 32 public bytes, as [operators] lists them
        self.public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.origin = origin

    @classmethod
    def generate(cls, name: str, origin: str = "generated") -> OperatorKey:
        return cls(name, Ed25519PrivateKey.generate(), origin)

    @classmethod
    def from_private_bytes(cls, name: str, raw: bytes, origin: str) -> OperatorKey:
        return cls(name, Ed25519PrivateKey.from_private_bytes(raw), origin)

    def sign(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``message``."""
        return self._private.sign(message)

    def file_text(self) -> str:
        """The key file's one line: ``NAME:BASE64`` and a newline."""
        raw = self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return f"{self.name}:{base64.b64encode(raw).decode()}\n"

    @property
    def public_text(self) -> str:
        return public_key_text(self.public)

    @property
    def operators_line(self) -> str:
        """The line that lists this key under [operators]."""
        return f'{self.name} = "{self.public_text}"'

    def __repr__(self) -> str:
        return (
            f"OperatorKey(name={self.name!r}, public={self.public_text}, "
            f"origin={self.origin!r}, private redacted)"
        )

    __str__ = __repr__

    def __reduce__(self) -> str:
        raise TypeError("an OperatorKey is never serialized")


def _parse(raw: bytes, where: str) -> tuple[str, bytes]:
    """(name, private bytes) of a key file's content; ConfigurationError when it is not one."""
    text = raw.decode("ascii", "replace").strip()
    name, sep, encoded = text.partition(":")
    try:
        key = base64.b64decode(encoded, validate=True) if sep else b""
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != 32 or name_problem(name, "the operator name") is not None:
        raise ConfigurationError(
            f"{where} does not hold an operator key (one line NAME:BASE64); {_HINT}"
        )
    return name, key


def load_operator_key(
    path: str | os.PathLike[str],
    *,
    named_by: str = OPERATOR_KEY_FLAG,
    environ: Mapping[str, str] | None = None,
    allow_loose: bool | None = None,
) -> OperatorKey:
    """Read an operator key file; unreadable, loose or malformed is one ConfigurationError
    naming the file and the command that makes one."""
    environ = os.environ if environ is None else environ
    where = Path(path).expanduser()
    raw = read_private_file(
        where,
        what=_WHAT,
        named_by=named_by,
        allow_loose=allow_loose_from(environ) if allow_loose is None else allow_loose,
        hint=_HINT,
    )
    name, key = _parse(raw, f"{_WHAT} {where}")
    return OperatorKey.from_private_bytes(name, key, f"{named_by} ({where})")


def write_new_operator_key(path: Path, name: str, *, force: bool = False) -> OperatorKey:
    """A fresh key for operator ``name`` written to ``path`` (mode 0600); an existing file
    needs ``force``."""
    key = OperatorKey.generate(name, str(path))
    write_private_file(
        path,
        key.file_text().encode(),
        what=_WHAT,
        force=force,
        replaced=f"the operator's line in {OPERATORS_KEY} then needs the new public key",
    )
    return key


@dataclass(frozen=True)
class Operators:
    """Operator name -> 32-byte Ed25519 public key: who may sign admin requests."""

    entries: tuple[tuple[str, bytes], ...] = ()

    @classmethod
    def from_table(cls, table: Mapping[str, str]) -> Operators:
        """``[operators]`` as ClusterConfig validated it (names and keys already checked)."""
        return cls(tuple(sorted((name, parse_public_key(text)) for name, text in table.items())))

    @classmethod
    def of(cls, keys: Mapping[str, bytes]) -> Operators:
        return cls(tuple(sorted(keys.items())))

    def key_of(self, name: str) -> bytes | None:
        for listed, key in self.entries:
            if listed == name:
                return key
        return None

    def verifies(self, name: str, message: bytes, signature: bytes) -> bool:
        """Whether ``name`` is listed and ``signature`` is its key's over ``message``. An
        unknown name costs a verification too, so the two refusals cannot be told apart."""
        listed = self.key_of(name)
        public = Ed25519PublicKey.from_public_bytes(listed or _NOBODY)
        try:
            public.verify(signature, message)
        except InvalidSignature:
            return False
        return listed is not None

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


# What an unknown name is checked against (and then refused whatever the outcome).
_NOBODY = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


@functools.lru_cache(maxsize=8)
def _cached(items: tuple[tuple[str, str], ...]) -> Operators:
    return Operators.from_table(dict(items))


def operators_of(table: Mapping[str, str]) -> Operators:
    """``[operators]`` parsed once per distinct table (a reload may bring a new one)."""
    return _cached(tuple(sorted(table.items())))


def parse_operator_flags(values: tuple[str, ...], *, source: str) -> dict[str, str]:
    """``NAME=PUBLIC_KEY`` values (``mlxppd serve --operator``) as an ``[operators]`` table;
    a bad one is a ConfigurationError naming ``source``."""
    table: dict[str, str] = {}
    for value in values:
        # The printed line (name = "key") pasted as it is works too.
        name, sep, text = value.partition("=")
        name, text = name.strip(), text.strip().strip('"')
        problem = name_problem(name, "the operator name") if sep else "it has no '='"
        if problem is None:
            try:
                parse_public_key(text)
            except ValueError as exc:
                problem = str(exc)
        if problem is None and name in table:
            problem = f"operator '{name}' is given twice"
        if problem is not None:
            shown = value if len(value) <= 80 else value[:80] + "..."
            raise ConfigurationError(
                f"{shown!r} is not NAME=PUBLIC_KEY: {problem}; give the line that "
                "`mlxppctl operator-key new` printed",
                source=source,
            )
        table[name] = text
    return table
