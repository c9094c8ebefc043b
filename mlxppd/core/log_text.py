"""Text from outside (a request path, a peer's node id or cluster name) made safe to log.

A client or peer that could put a newline or an escape sequence into a log line could forge
lines or hide its own: everything not printable ASCII is written as a Python escape.
"""

from __future__ import annotations

#: characters of outside text kept in one log line
DEFAULT_LIMIT = 256


def escape(text: str, limit: int = DEFAULT_LIMIT) -> str:
    """``text`` with control characters, non-ASCII and lone surrogates backslash-escaped."""
    clipped = text[:limit]
    out = clipped.encode("unicode_escape").decode("ascii")
    return out + "..." if len(text) > limit else out


def quoted(text: str, limit: int = DEFAULT_LIMIT) -> str:
    """``escape(text)`` quoted as ``repr`` quotes, for a name inside a sentence: ``'a\\nb'``."""
    out = escape(text, limit)
    if "'" in out and '"' not in out:
        return f'"{out}"'
    return "'" + out.replace("'", "\\'") + "'"
