"""Files that hold credentials (the cluster secret, an API key file): read safely, or refused.

The rule (docs/operations.md, "The cluster secret"): the file is opened without following a
symbolic link (``O_NOFOLLOW``) and checked on the opened descriptor (``fstat``), so what is
checked is what is read. It must be a regular file, give no permission to group or others
(``chmod 600``), and be owned by the user reading it or by root; root itself may read a file of
any owner (``sudo mlxppctl`` reads the service account's file). ``--allow-loose-secret-file``,
or ``MLXPP_ALLOW_LOOSE_SECRET_FILE=1``, turns each of these refusals into a warning (and follows
a link), for setups such as mounted volumes that cannot meet it.

The content never appears in an error or a log line. The opening half of the rule (no link,
a regular file, checked on the descriptor) is :func:`open_regular_file`, which adapter files
share (``engine/adapters/reader.py``).
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from mlxppd.core.errors import ConfigurationError

__all__ = [
    "ALLOW_LOOSE_FLAG",
    "ENV_ALLOW_LOOSE",
    "MAX_PRIVATE_FILE_BYTES",
    "FileRefused",
    "allow_loose_from",
    "open_regular_file",
    "read_private_file",
    "write_private_file",
]

log = logging.getLogger(__name__)

ENV_ALLOW_LOOSE = "MLXPP_ALLOW_LOOSE_SECRET_FILE"
ALLOW_LOOSE_FLAG = "--allow-loose-secret-file"
#: a secret or key file is tiny; never read a huge one
MAX_PRIVATE_FILE_BYTES = 64 * 1024

_TRUE = frozenset({"1", "true", "yes", "on"})
_OVERRIDE = f"or pass {ALLOW_LOOSE_FLAG} (or set {ENV_ALLOW_LOOSE}=1) to use it anyway"


def allow_loose_from(environ: Mapping[str, str]) -> bool:
    """Whether ``MLXPP_ALLOW_LOOSE_SECRET_FILE`` is set to 1/true/yes/on (any case)."""
    return environ.get(ENV_ALLOW_LOOSE, "").strip().lower() in _TRUE


def _user(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def _looseness(st: os.stat_result, path: Path) -> str | None:
    """Why the opened file is too loose for a credential, with the fix; None when it is fine."""
    quoted = shlex.quote(str(path))
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"is accessible to group or other users (mode {mode:04o}); run `chmod 600 {quoted}`"
    me = os.geteuid()
    if me != 0 and st.st_uid not in (me, 0):
        return (
            f"is owned by {_user(st.st_uid)} (uid {st.st_uid}), not by {_user(me)} (uid {me}) "
            f"who reads it, nor by root; run `sudo chown {_user(me)} {quoted}`"
        )
    return None


class FileRefused(Exception):
    """The path is not a plain file to read: ``kind`` says why (the caller words the error)."""

    def __init__(self, kind: Literal["symlink", "not_regular", "too_large"]) -> None:
        super().__init__(kind)
        self.kind = kind


def open_regular_file(
    path: Path, *, follow_links: bool = False, max_bytes: int | None = None
) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its ``fstat``, the last component opened without
    following a symbolic link (unless ``follow_links``), so what is checked is what is read.

    Raises :class:`FileRefused` for a link, anything but a regular file, or one larger than
    ``max_bytes``; ``OSError`` when it cannot be opened. The caller closes the descriptor.
    """
    # O_NONBLOCK: a FIFO put in the file's place must not hang the open.
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) and path.is_symlink():
            raise FileRefused("symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused("not_regular")
        if max_bytes is not None and st.st_size > max_bytes:
            raise FileRefused("too_large")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_private_file(
    path: Path, *, what: str, named_by: str, allow_loose: bool, hint: str = ""
) -> bytes:
    """The bytes of a credential file, or a ConfigurationError naming it and the fix.

    ``what`` names the file's kind ("the cluster secret file"), ``named_by`` where its path came
    from (a flag, a variable, a TOML key); ``hint`` is appended to "cannot read" errors.
    """
    where = f"{what} {path} named by {named_by}"
    tail = f"; {hint}" if hint else ""
    try:
        fd, st = open_regular_file(path, follow_links=allow_loose)
    except FileRefused as exc:
        if exc.kind == "symlink":
            raise ConfigurationError(
                f"{where} is a symbolic link, and credential files are opened without following "
                f"links; point {named_by} at the file itself (`readlink -f "
                f"{shlex.quote(str(path))}`), {_OVERRIDE}"
            ) from None
        raise ConfigurationError(
            f"{where} is not a regular file; point {named_by} at the file itself"
        ) from None
    except OSError as exc:
        raise ConfigurationError(f"cannot read {where}: {exc.strerror or exc}{tail}") from None
    try:
        loose = _looseness(st, path)
        if loose is not None and not allow_loose:
            raise ConfigurationError(f"{where} {loose}, {_OVERRIDE}")
        if loose is not None or path.is_symlink():
            log.warning(
                "%s %s %s; used because of %s",
                what,
                path,
                loose or "is a symbolic link",
                ALLOW_LOOSE_FLAG,
            )
        data = _read_bounded(fd)
    except OSError as exc:
        raise ConfigurationError(f"cannot read {where}: {exc.strerror or exc}{tail}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_PRIVATE_FILE_BYTES:
        raise ConfigurationError(
            f"{where} is larger than {MAX_PRIVATE_FILE_BYTES // 1024} KiB; point {named_by} at "
            "the file itself"
        )
    return data


def _read_bounded(fd: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_PRIVATE_FILE_BYTES:
        chunk = os.read(fd, MAX_PRIVATE_FILE_BYTES + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def write_private_file(path: Path, data: bytes, *, what: str, force: bool, replaced: str) -> None:
    """Write ``data`` to ``path`` with mode 0600; an existing file needs ``force``, and then is
    replaced atomically. ``what`` names the file in errors, ``replaced`` says what replacing it
    means ("every host of the cluster then needs the new secret")."""
    try:
        if not force:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                raise ConfigurationError(
                    f"{path} already exists; pass --force to replace it ({replaced})"
                ) from None
            _write_all(fd, data)
            return
        # Replace atomically: a crash never leaves a half-written or world-readable file.
        fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=".mlxpp-private-")
        try:
            _write_all(fd, data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ConfigurationError(f"cannot write {what} {path}: {exc.strerror or exc}") from None


def _write_all(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # the umask may not loosen it, but be exact anyway
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
