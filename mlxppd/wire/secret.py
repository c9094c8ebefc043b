"""The cluster secret: where it is looked up, how it is read, and how a new one is made.

The lookup order (docs/operations.md, "The cluster secret"):
``--cluster-secret-file``, then ``MLXPP_CLUSTER_SECRET_FILE`` (a path), then
``MLXPP_CLUSTER_SECRET`` (the value), then ``[cluster] secret_file`` in the cluster TOML.
The secret is the file's (or variable's) bytes with surrounding whitespace removed, so the
``openssl rand -hex 32 > cluster.secret`` recipe and ``mlxppctl secret new`` both work.

The bytes never appear in a repr, an error message or a log line.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlxppd.core.errors import ConfigurationError

__all__ = [
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "MIN_SECRET_BYTES",
    "SECRET_SOURCES",
    "ClusterSecret",
    "SecretSource",
    "load_cluster_secret",
    "new_secret_text",
    "resolve_secret_source",
    "write_new_secret",
]

log = logging.getLogger(__name__)

ENV_SECRET_FILE = "MLXPP_CLUSTER_SECRET_FILE"
ENV_SECRET = "MLXPP_CLUSTER_SECRET"
FLAG = "--cluster-secret-file"
CONFIG_KEY = "[cluster] secret_file"
#: Every place the secret is looked up, in lookup order.
SECRET_SOURCES: tuple[str, ...] = (FLAG, ENV_SECRET_FILE, ENV_SECRET, CONFIG_KEY)
MIN_SECRET_BYTES = 16

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
) -> ClusterSecret:
    """Find and read the cluster secret; a missing or short one is a ConfigurationError."""
    source = resolve_secret_source(
        flag_path=flag_path,
        environ=os.environ if environ is None else environ,
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
        raw = _read_secret_file(source)
    value = raw.strip()
    if len(value) < MIN_SECRET_BYTES:
        raise ConfigurationError(
            f"the cluster secret from {_describe(source)} is {len(value)} bytes, shorter than "
            f"the {MIN_SECRET_BYTES} bytes required; {_SOURCES_HELP}"
        )
    return ClusterSecret(value, _describe(source))


def _read_secret_file(source: SecretSource) -> bytes:
    assert source.path is not None
    try:
        with open(source.path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(64 * 1024 + 1)  # a secret file is tiny; never slurp a huge one
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the cluster secret file {source.path} named by {source.origin}: "
            f"{exc.strerror or exc}; {_SOURCES_HELP}"
        ) from None
    if len(raw) > 64 * 1024:
        raise ConfigurationError(
            f"the cluster secret file {source.path} named by {source.origin} is larger than "
            "64 KiB; point it at the secret file itself"
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "cluster secret file %s is accessible to other users (mode %03o); run chmod 600 on it",
            source.path,
            stat.S_IMODE(mode),
        )
    return raw


def new_secret_text() -> str:
    """A fresh secret in the file format: 32 random bytes, hex-encoded, newline-terminated."""
    return secrets.token_hex(32) + "\n"


def write_new_secret(path: Path, *, force: bool = False) -> None:
    """Write a fresh secret to ``path`` with mode 0600; an existing file needs ``force``."""
    data = new_secret_text().encode()
    try:
        if not force:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                raise ConfigurationError(
                    f"{path} already exists; pass --force to replace it (every host of the "
                    "cluster then needs the new secret)"
                ) from None
            _write_all(fd, data)
            return
        # Replace atomically: a crash never leaves a half-written or world-readable secret.
        fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=".mlxpp-secret-")
        try:
            _write_all(fd, data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ConfigurationError(
            f"cannot write the cluster secret file {path}: {exc.strerror or exc}"
        ) from None


def _write_all(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # the umask may not loosen it, but be exact anyway
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
