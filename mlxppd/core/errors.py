"""The small error hierarchy every layer raises.

A user sees ``str(error)``: one sentence saying what is wrong and what to do.
"""

from __future__ import annotations


class MlxppError(Exception):
    """Base of every error mlxpp raises on purpose."""

    #: process exit status the CLI uses for this kind of error
    exit_code: int = 1


class ConfigurationError(MlxppError):
    """Bad input from a user: a flag, a TOML file, a model directory.

    ``source`` names the file or flag, ``key`` the key path inside it.
    """

    exit_code = 2

    def __init__(self, message: str, *, source: str | None = None, key: str | None = None):
        self.message = message
        self.source = source
        self.key = key
        where = ""
        if source and key:
            where = f"{source}: {key}: "
        elif source:
            where = f"{source}: "
        elif key:
            where = f"{key}: "
        super().__init__(f"{where}{message}")


class PeerRefusedError(MlxppError):
    """A peer answered and said no (bad secret, version mismatch, at capacity)."""


class TemporaryError(MlxppError):
    """Worth retrying: a peer is not up yet, a resource is busy."""


class PermanentError(MlxppError):
    """Retrying will not help until something is changed."""
