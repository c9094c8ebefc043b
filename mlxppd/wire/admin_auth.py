"""Signed admin requests: an HMAC over each request with a key derived from the cluster secret.

Neither the secret nor the derived key travels. A request carries
``Authorization: MLXPP-HMAC ts=<unix seconds>,nonce=<32 hex>,mac=<64 hex>`` where the MAC covers
the method, the path, the timestamp, the nonce, the SHA-256 of the body, the cluster's name and
the HTTP ``Host`` header; the verifier refuses stale timestamps and nonces it has seen, signs
with its own cluster's name (so a request signed for another cluster fails), and the admin API
refuses a ``Host`` that does not name this server (``host_names_this_server``), so a request
signed for one host cannot be replayed to another. ``docs/admin-api.md`` is the reference.
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

from mlxppd.core.config.addresses import split_host_port
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
    "challenge",
    "challenged_cluster",
    "host_names_this_server",
    "sign_request",
]

SCHEME = "MLXPP-HMAC"
HKDF_SALT = b"mlxpp admin api"
HKDF_INFO = b"mlxpp admin v1"
#: a well-formed header is about 130 characters; anything far longer is refused unparsed
MAX_HEADER_CHARS = 512

AuthReason = Literal["missing", "malformed", "stale", "bad_mac", "replayed", "wrong_host"]
AUTH_REASONS: tuple[AuthReason, ...] = (
    "missing",
    "malformed",
    "stale",
    "bad_mac",
    "replayed",
    "wrong_host",
)

_NONCE = re.compile(r"[0-9a-f]{32}")
_MAC = re.compile(r"[0-9a-f]{64}")
_TS = re.compile(r"[0-9]{1,12}")
_CHALLENGE = re.compile(rf'{SCHEME} cluster="([A-Za-z0-9._-]{{0,255}})"')


class AdminAuthError(MlxppError):
    """An admin request failed verification; ``reason`` is one of ``AUTH_REASONS``."""

    def __init__(self, reason: AuthReason):
        self.reason: AuthReason = reason
        super().__init__(f"admin request refused: {reason}")


def admin_key(secret: bytes) -> bytes:
    """The 32-byte admin API key: HKDF-SHA256 of the cluster secret (never the secret itself)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=HKDF_SALT, info=HKDF_INFO).derive(secret)


def canonical_request(
    method: str, path: str, ts: str, nonce: str, body: bytes, *, cluster: str, host: str
) -> bytes:
    """The bytes the MAC covers, one a line: method, path, ts, nonce, the body's SHA-256, the
    cluster's name and the Host header (lower-cased)."""
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join((method.upper(), path, ts, nonce, digest, cluster, host.lower())).encode()


def _mac(key: bytes, request: bytes) -> str:
    return hmac.new(key, request, "sha256").hexdigest()


def sign_request(
    key: bytes,
    method: str,
    path: str,
    body: bytes,
    *,
    now: float,
    cluster: str,
    host: str,
    nonce: str | None = None,
) -> str:
    """The ``Authorization`` header value for one request (``path`` as sent, query included;
    ``cluster`` the cluster's name; ``host`` the Host header the request carries)."""
    if nonce is None:
        nonce = secrets.token_hex(16)
    elif not _NONCE.fullmatch(nonce):
        raise ValueError("a nonce is 32 lowercase hex digits")
    ts = str(int(now))
    mac = _mac(key, canonical_request(method, path, ts, nonce, body, cluster=cluster, host=host))
    return f"{SCHEME} ts={ts},nonce={nonce},mac={mac}"


def challenge(cluster: str) -> str:
    """The ``WWW-Authenticate`` value of a refusal: the scheme and the cluster to sign for."""
    return f'{SCHEME} cluster="{cluster}"'


def challenged_cluster(header: str | None) -> str | None:
    """The cluster name in a ``WWW-Authenticate`` challenge, or None when there is none."""
    match = _CHALLENGE.fullmatch((header or "").strip())
    return match[1] if match else None


def host_names_this_server(
    host: str, local_port: int, is_local: Callable[[str], bool], *, default_port: int = 80
) -> bool:
    """Whether a ``Host`` header names this server: its port (``default_port`` when absent) is
    the port the connection arrived on, and its host is one of this machine's addresses (or a
    name for one), as ``is_local`` says."""
    if not host:
        return False
    split = split_host_port(host)
    if split is None:
        name, port = (host[1:-1] if host.startswith("[") else host), default_port
    else:
        name, port = split
    if port != local_port or not name or "[" in name or "]" in name:
        return False
    return is_local(name.lower())


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
        cluster_name: str | Callable[[], str],
        clock: Callable[[], float],
        window_s: float = 60.0,
        max_nonces: int = 10_000,
    ) -> None:
        if len(key) < 16:
            raise ValueError("an admin key has at least 16 bytes")
        if window_s <= 0 or max_nonces < 1:
            raise ValueError("window_s must be positive and max_nonces at least 1")
        self._key = key
        # A callable follows a name that a reload may change (the agent's coordinator).
        self._cluster_name = cluster_name
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

    @property
    def cluster_name(self) -> str:
        """The cluster name requests must be signed for."""
        name = self._cluster_name
        return name if isinstance(name, str) else name()

    def verify(self, header: str | None, method: str, path: str, body: bytes, *, host: str) -> None:
        """Accept the request (``host``: its Host header) or raise AdminAuthError with the
        reason. Whether ``host`` names this server is the caller's check
        (``host_names_this_server``); the MAC only proves the client signed that Host."""
        ts, nonce, mac = self._fresh(header)
        now = self._clock()
        stamp = int(ts)
        request = canonical_request(
            method, path, ts, nonce, body, cluster=self.cluster_name, host=host
        )
        expected = _mac(self._key, request)
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

    def check_header(self, header: str | None) -> None:
        """What the header alone shows, before the body is read (AdminAuthError otherwise):
        present, well formed, its timestamp within the window. ``verify`` still checks all."""
        self._fresh(header)

    def _fresh(self, header: str | None) -> tuple[str, str, str]:
        if not header:
            raise AdminAuthError("missing")
        if len(header) > MAX_HEADER_CHARS:
            raise AdminAuthError("malformed")
        ts, nonce, mac = _parse(header)
        if abs(self._clock() - int(ts)) > self._window_s:
            raise AdminAuthError("stale")
        return ts, nonce, mac

    def _expire(self, now: float) -> None:
        # A nonce with timestamp ts can only come back while ts is within the window.
        while self._expiry and self._expiry[0][0] + self._window_s < now:
            _, nonce = heapq.heappop(self._expiry)
            self._seen.discard(nonce)
