"""The cluster secret: where it is looked up, how it is read, and how a new one is made.

The lookup order (docs/operations.md, "The cluster secret"):
``--cluster-secret-file``, then ``MLXPP_CLUSTER_SECRET_FILE`` (a path), then
``MLXPP_CLUSTER_SECRET`` (the value), then ``[cluster] secret_file`` in the cluster TOML.
The secret is the file's (or variable's) bytes with surrounding whitespace removed, so the
``openssl rand -hex 32 > cluster.secret`` recipe and ``mlxppctl secret new`` both work.

A secret must carry at least 128 bits of randomness, and its form says whether it can: at least
32 hex digits, or at least 22 base64 / base64url characters (16 bytes; line breaks allowed), or
at least 16 bytes that are not text (raw random bytes). Any other text, such as a password or a
passphrase, is refused, as are lower-case words (``correct-horse-battery-staple``) and a value of
fewer than 8 distinct characters. The form is all that can
be checked: ``mlxppctl secret new PATH`` makes a good one. A secret file is read as
``mlxppd.core.config.private_file`` says (no symbolic link; mode 600; owned by the reader or
root).

The bytes never appear in a repr, an error message or a log line.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlxppd.core.config.private_file import (
    ALLOW_LOOSE_FLAG,
    ENV_ALLOW_LOOSE,
    allow_loose_from,
    read_private_file,
    write_private_file,
)
from mlxppd.core.errors import ConfigurationError

__all__ = [
    "ALLOW_LOOSE_FLAG",
    "ENV_ALLOW_LOOSE",
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "MIN_SECRET_BYTES",
    "SECRET_SOURCES",
    "ClusterSecret",
    "SecretSource",
    "load_cluster_secret",
    "new_secret_text",
    "resolve_secret_source",
    "secret_weakness",
    "write_new_secret",
]

ENV_SECRET_FILE = "MLXPP_CLUSTER_SECRET_FILE"
ENV_SECRET = "MLXPP_CLUSTER_SECRET"
FLAG = "--cluster-secret-file"
CONFIG_KEY = "[cluster] secret_file"
#: Every place the secret is looked up, in lookup order.
SECRET_SOURCES: tuple[str, ...] = (FLAG, ENV_SECRET_FILE, ENV_SECRET, CONFIG_KEY)
MIN_SECRET_BYTES = 16
#: 128 bits written as hex (4 bits a digit) and as base64 (6 bits a character)
MIN_HEX_DIGITS = 32
MIN_BASE64_CHARS = 22
#: fewer distinct characters than this is a pattern, not randomness
MIN_DISTINCT = 8
_HEX = re.compile(rb"[0-9A-Fa-f]+")
_BASE64 = re.compile(rb"([A-Za-z0-9+/]+|[A-Za-z0-9_-]+)(={0,2})")
#: lower-case words, maybe joined by - or _: a passphrase (random base64 is never only this)
_WORDS = re.compile(rb"[a-z_-]+")
_NEW_SECRET = (
    "a cluster secret carries at least 128 bits of randomness: at least 32 hex digits, 22 "
    "base64 characters or 16 random bytes; make one with `mlxppctl secret new PATH` and copy it "
    "to every host"
)

_SOURCES_HELP = (
    f"the secret is looked up in this order: 1. {FLAG} PATH, 2. {ENV_SECRET_FILE} (a path), "
    f"3. {ENV_SECRET} (the value), 4. {CONFIG_KEY} in the cluster TOML; create one with "
    "`mlxppctl secret new cluster.secret` and copy it to every host"
)


@dataclass(frozen=True)
class SecretSource:
    """Where the secret will come from: a file ``path``, or an environment ``value``."""

    origin: str  # one of SECRET_SOURCES
    path: Path | None = None
    value: str | None = field(default=None, repr=False)


def resolve_secret_source(
    *,
    flag_path: str | os.PathLike[str] | None,
    environ: Mapping[str, str],
    config_secret_file: str | None,
    config_dir: Path | None = None,
) -> SecretSource | None:
    """The first configured source in lookup order, or None; reads nothing (pure)."""
    if flag_path:
        return SecretSource(FLAG, Path(flag_path).expanduser())
    if environ.get(ENV_SECRET_FILE):
        return SecretSource(ENV_SECRET_FILE, Path(environ[ENV_SECRET_FILE]).expanduser())
    if environ.get(ENV_SECRET):
        return SecretSource(ENV_SECRET, value=environ[ENV_SECRET])
    if config_secret_file:
        path = Path(config_secret_file).expanduser()
        # A relative path in the TOML means "next to the TOML", whatever the working directory.
        if not path.is_absolute() and config_dir is not None:
            path = config_dir / path
        return SecretSource(CONFIG_KEY, path)
    return None


class ClusterSecret:
    """The pre-shared cluster secret; its repr and str never show the bytes."""

    __slots__ = ("_value", "origin")

    def __init__(self, value: bytes, origin: str):
        if len(value) < MIN_SECRET_BYTES:
            raise ValueError(f"a cluster secret has at least {MIN_SECRET_BYTES} bytes")
        self._value = bytes(value)
        self.origin = origin

    def key_bytes(self) -> bytes:
        """The secret itself: key material for HMAC and HKDF only, never for output."""
        return self._value

    def __repr__(self) -> str:
        return f"ClusterSecret(origin={self.origin!r}, {len(self._value)} bytes, redacted)"

    __str__ = __repr__

    def __reduce__(self) -> str:
        raise TypeError("a ClusterSecret is never serialized")


def _describe(source: SecretSource) -> str:
    return f"{source.origin} ({source.path})" if source.path else source.origin


def load_cluster_secret(
    *,
    flag_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    config_secret_file: str | None = None,
    config_dir: Path | None = None,
    allow_loose: bool | None = None,
) -> ClusterSecret:
    """Find and read the cluster secret; a missing, loose or weak one is a ConfigurationError.

    ``allow_loose`` (``--allow-loose-secret-file``; None: ``MLXPP_ALLOW_LOOSE_SECRET_FILE`` in
    ``environ``) lets a file that fails the permission rule be used, with a warning."""
    environ = os.environ if environ is None else environ
    source = resolve_secret_source(
        flag_path=flag_path,
        environ=environ,
        config_secret_file=config_secret_file,
        config_dir=config_dir,
    )
    if source is None:
        raise ConfigurationError(
            f"no cluster secret, and every pipeline role needs one; {_SOURCES_HELP}"
        )
    if source.path is None:
        raw = (source.value or "").encode()
    else:
        raw = read_private_file(
            source.path,
            what="the cluster secret file",
            named_by=source.origin,
            allow_loose=allow_loose_from(environ) if allow_loose is None else allow_loose,
            hint=_SOURCES_HELP,
        )
    value = raw.strip()
    weakness = secret_weakness(value)
    if weakness is not None:
        raise ConfigurationError(
            f"the cluster secret from {_describe(source)} is too weak ({weakness}); {_NEW_SECRET}"
        )
    return ClusterSecret(value, _describe(source))


def _is_text(value: bytes) -> bool:
    """UTF-8 without control characters other than tab and line breaks: typed, not random."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(c.isprintable() or c in "\t\r\n" for c in text)


def secret_weakness(value: bytes) -> str | None:
    """Why ``value`` (already stripped) cannot be a cluster secret, or None (pure).

    Hex needs 32 digits, base64/base64url 22 characters, raw bytes (anything that is not text)
    16 bytes; other text (a password, lower-case words) is refused, and so is a value of under
    8 distinct bytes."""
    if not value:
        return "it is empty"
    if _is_text(value):
        if _HEX.fullmatch(value):
            if len(value) < MIN_HEX_DIGITS:
                return f"{len(value)} hex digits, {len(value) * 4} bits"
        elif match := _BASE64.fullmatch(unwrapped := value.replace(b"\r", b"").replace(b"\n", b"")):
            # Base64 may come wrapped in lines (`openssl rand -base64 64`).
            chars = len(match[1])
            if chars % 4 == 1 or (match[2] and len(unwrapped) % 4):
                return "it is not valid base64"
            if chars < MIN_BASE64_CHARS:
                return f"{chars} characters, at most {chars * 6} bits even as base64"
            if _WORDS.fullmatch(unwrapped):
                return "it is lower-case words, like a passphrase"
        else:
            return "it is text that is neither hex nor base64, like a password or a passphrase"
    elif len(value) < MIN_SECRET_BYTES:
        return f"{len(value)} bytes"
    if len(set(value)) < MIN_DISTINCT:
        return f"only {len(set(value))} distinct characters, a pattern rather than random"
    return None


def new_secret_text() -> str:
    """A fresh secret in the file format: 32 random bytes, hex-encoded, newline-terminated."""
    return secrets.token_hex(32) + "\n"


def write_new_secret(path: Path, *, force: bool = False) -> None:
    """Write a fresh secret to ``path`` with mode 0600; an existing file needs ``force``."""
    write_private_file(
        path,
        new_secret_text().encode(),
        what="the cluster secret file",
        force=force,
        replaced="every host of the cluster then needs the new secret",
    )
