"""Signed admin requests: an HMAC over each request with a key derived from the cluster secret.

Neither the secret nor the derived key travels. A request carries
``Authorization: MLXPP-HMAC ts=<unix seconds>,nonce=<32 hex>,mac=<64 hex>`` where the MAC covers
the method, the path, the timestamp, the nonce and the SHA-256 of the body; the verifier refuses
stale timestamps and nonces it has seen. ``docs/admin-api.md`` is the reference.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
from collections.abc import Callable
from typing import Literal

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxppd.core.errors import MlxppError

__all__ = [
    "AUTH_REASONS",
    "HKDF_INFO",
    "HKDF_SALT",
    "MAX_HEADER_CHARS",
    "SCHEME",
    "AdminAuthError",
    "AdminVerifier",
    "AuthReason",
    "admin_key",
    "canonical_request",
    "sign_request",
]

SCHEME = "MLXPP-HMAC"
HKDF_SALT = b"mlxpp admin api"
HKDF_INFO = b"mlxpp admin v1"
#: a well-formed header is about 130 characters; anything far longer is refused unparsed
MAX_HEADER_CHARS = 512

AuthReason = Literal["missing", "malformed", "stale", "bad_mac", "replayed"]
AUTH_REASONS: tuple[AuthReason, ...] = ("missing", "malformed", "stale", "bad_mac", "replayed")

_NONCE = re.compile(r"[0-9a-f]{32}")
_MAC = re.compile(r"[0-9a-f]{64}")
_TS = re.compile(r"[0-9]{1,12}")


class AdminAuthError(MlxppError):
    """An admin request failed verification; ``reason`` is one of ``AUTH_REASONS``."""

    def __init__(self, reason: AuthReason):
        self.reason: AuthReason = reason
        super().__init__(f"admin request refused: {reason}")


def admin_key(secret: bytes) -> bytes:
    """The 32-byte admin API key: HKDF-SHA256 of the cluster secret (never the secret itself)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=HKDF_SALT, info=HKDF_INFO).derive(secret)


def canonical_request(method: str, path: str, ts: str, nonce: str, body: bytes) -> bytes:
    """The bytes the MAC covers: method, path, ts, nonce and the body's SHA-256, one a line."""
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join((method.upper(), path, ts, nonce, digest)).encode()


def _mac(key: bytes, method: str, path: str, ts: str, nonce: str, body: bytes) -> str:
    return hmac.new(key, canonical_request(method, path, ts, nonce, body), "sha256").hexdigest()


def sign_request(
    key: bytes, method: str, path: str, body: bytes, *, now: float, nonce: str | None = None
) -> str:
    """The ``Authorization`` header value for one request (``path`` as sent, query included)."""
    if nonce is None:
        nonce = secrets.token_hex(16)
    elif not _NONCE.fullmatch(nonce):
        raise ValueError("a nonce is 32 lowercase hex digits")
    ts = str(int(now))
    return f"{SCHEME} ts={ts},nonce={nonce},mac={_mac(key, method, path, ts, nonce, body)}"


def _parse(header: str) -> tuple[str, str, str]:
    """(ts, nonce, mac) of a header, or AdminAuthError("malformed")."""
    scheme, sep, params = header.partition(" ")
    if not sep or scheme != SCHEME:
        raise AdminAuthError("malformed")
    fields: dict[str, str] = {}
    for part in params.split(","):
        name, eq, value = part.partition("=")
        if not eq or name not in ("ts", "nonce", "mac") or name in fields:
            raise AdminAuthError("malformed")
        fields[name] = value
    if len(fields) != 3:
        raise AdminAuthError("malformed")
    ts, nonce, mac = fields["ts"], fields["nonce"], fields["mac"]
    if not (_TS.fullmatch(ts) and _NONCE.fullmatch(nonce) and _MAC.fullmatch(mac)):
        raise AdminAuthError("malformed")
    return ts, nonce, mac


class AdminVerifier:
    """Checks signed admin requests and remembers their nonces for the freshness window.

    At most ``max_nonces`` nonces are kept. When a valid request would exceed that, the nonce
    that expires first is forgotten and every timestamp up to its own is refused from then on
    (as stale), so forgetting never reopens a replay.
    """

    def __init__(
        self,
        key: bytes,
        *,
        clock: Callable[[], float],
        window_s: float = 60.0,
        max_nonces: int = 10_000,
    ) -> None:
        if len(key) < 16:
            raise ValueError("an admin key has at least 16 bytes")
        if window_s <= 0 or max_nonces < 1:
            raise ValueError("window_s must be positive and max_nonces at least 1")
        self._key = key
        self._clock = clock
        self._window_s = window_s
        self._max_nonces = max_nonces
        self._seen: set[str] = set()
        self._expiry: list[tuple[int, str]] = []  # heap of (ts, nonce), earliest first
        self._forgotten_up_to = -1  # timestamps at or below this were evicted early

    def __repr__(self) -> str:
        return f"AdminVerifier(window_s={self._window_s}, {len(self._seen)} nonces, key redacted)"

    @property
    def remembered(self) -> int:
        """How many nonces are held now."""
        return len(self._seen)

    def verify(self, header: str | None, method: str, path: str, body: bytes) -> None:
        """Accept the request or raise AdminAuthError with the reason."""
        if not header:
            raise AdminAuthError("missing")
        if len(header) > MAX_HEADER_CHARS:
            raise AdminAuthError("malformed")
        ts, nonce, mac = _parse(header)
        now = self._clock()
        stamp = int(ts)
        if abs(now - stamp) > self._window_s:
            raise AdminAuthError("stale")
        expected = _mac(self._key, method, path, ts, nonce, body)
        if not hmac.compare_digest(expected, mac):
            raise AdminAuthError("bad_mac")
        # Nonces are recorded only after the MAC checks out: without the key nobody can
        # fill the memory or push genuine requests out of it.
        self._expire(now)
        if stamp <= self._forgotten_up_to:
            raise AdminAuthError("stale")
        if nonce in self._seen:
            raise AdminAuthError("replayed")
        self._seen.add(nonce)
        heapq.heappush(self._expiry, (stamp, nonce))
        while len(self._seen) > self._max_nonces:
            old_ts, old_nonce = heapq.heappop(self._expiry)
            self._seen.discard(old_nonce)
            self._forgotten_up_to = max(self._forgotten_up_to, old_ts)

    def _expire(self, now: float) -> None:
        # A nonce with timestamp ts can only come back while ts is within the window.
        while self._expiry and self._expiry[0][0] + self._window_s < now:
            _, nonce = heapq.heappop(self._expiry)
            self._seen.discard(nonce)
