"""Signed admin requests: an operator's Ed25519 signature, or (legacy) an HMAC with a key
derived from the cluster secret.

A request carries ``Authorization: MLXPP-ED25519 name=<operator>,ts=<unix seconds>,nonce=<32
hex>,sig=<base64>`` (a key listed under the cluster TOML's ``[operators]``,
``wire/operator_key.py``) or ``Authorization: MLXPP-HMAC ts=..,nonce=..,mac=<64 hex>``. Both
cover the same canonical request: the method, the path, the timestamp, the nonce, the SHA-256
of the body, the cluster's name and the HTTP ``Host`` header. The verifier refuses stale
timestamps and nonces it has seen, checks against its own cluster's name (so a request signed
for another cluster fails), and the admin API refuses a ``Host`` that does not name this server
(``host_names_this_server``), so a request signed for one host cannot be replayed to another.

Once ``[operators]`` lists anyone, only their signatures are accepted: every stage host holds
the cluster secret, so an HMAC proves only that the signer is one of them. Without
``[operators]`` the HMAC scheme is accepted (legacy mode). ``docs/admin-api.md`` is the
reference.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import hmac
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxppd.core.config.addresses import split_host_port
from mlxppd.core.errors import MlxppError
from mlxppd.wire.operator_key import SIGNATURE_BYTES, OperatorKey, Operators

__all__ = [
    "AUTH_REASONS",
    "ED25519_SCHEME",
    "HKDF_INFO",
    "HKDF_SALT",
    "MAX_HEADER_CHARS",
    "NO_OPERATORS",
    "SCHEME",
    "AdminAuthError",
    "AdminVerifier",
    "AuthReason",
    "admin_key",
    "canonical_request",
    "challenge",
    "challenged_cluster",
    "host_names_this_server",
    "operator_message",
    "sign_operator_request",
    "sign_request",
]

SCHEME = "MLXPP-HMAC"
ED25519_SCHEME = "MLXPP-ED25519"
HKDF_SALT = b"mlxpp admin api"
HKDF_INFO = b"mlxpp admin v1"
#: a well-formed header is at most about 430 characters (an operator name of 255); anything
#: longer is refused unparsed
MAX_HEADER_CHARS = 512

AuthReason = Literal[
    "missing",
    "malformed",
    "stale",
    "bad_mac",
    "bad_signature",
    "operator_key_required",
    "replayed",
    "wrong_host",
]
AUTH_REASONS: tuple[AuthReason, ...] = (
    "missing",
    "malformed",
    "stale",
    "bad_mac",
    "bad_signature",
    "operator_key_required",
    "replayed",
    "wrong_host",
)

_NONCE = re.compile(r"[0-9a-f]{32}")
_MAC = re.compile(r"[0-9a-f]{64}")
_TS = re.compile(r"[0-9]{1,12}")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
_SIG = re.compile(r"[A-Za-z0-9+/]{86}==")
_CHALLENGE = re.compile(rf'(?:{SCHEME}|{ED25519_SCHEME}) cluster="([A-Za-z0-9._-]{{0,255}})"')
#: legacy mode: nobody listed, the secret-derived key signs
NO_OPERATORS = Operators()
_FIELDS = {SCHEME: ("ts", "nonce", "mac"), ED25519_SCHEME: ("name", "ts", "nonce", "sig")}


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


def _stamp(now: float, nonce: str | None) -> tuple[str, str]:
    """The timestamp and nonce a signature covers (a fresh random nonce unless given)."""
    if nonce is None:
        nonce = secrets.token_hex(16)
    elif not _NONCE.fullmatch(nonce):
        raise ValueError("a nonce is 32 lowercase hex digits")
    return str(int(now)), nonce


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
    ts, nonce = _stamp(now, nonce)
    mac = _mac(key, canonical_request(method, path, ts, nonce, body, cluster=cluster, host=host))
    return f"{SCHEME} ts={ts},nonce={nonce},mac={mac}"


def operator_message(name: str, request: bytes) -> bytes:
    """The bytes an operator signs: the scheme and the operator's name, one a line, then the
    canonical request (so a signature is never valid for another name or another use)."""
    return f"{ED25519_SCHEME}\n{name}\n".encode() + request


def sign_operator_request(
    key: OperatorKey,
    method: str,
    path: str,
    body: bytes,
    *,
    now: float,
    cluster: str,
    host: str,
    nonce: str | None = None,
) -> str:
    """The ``MLXPP-ED25519`` ``Authorization`` value for one request, signed by ``key``."""
    ts, nonce = _stamp(now, nonce)
    request = canonical_request(method, path, ts, nonce, body, cluster=cluster, host=host)
    sig = base64.b64encode(key.sign(operator_message(key.name, request))).decode()
    return f"{ED25519_SCHEME} name={key.name},ts={ts},nonce={nonce},sig={sig}"


def challenge(cluster: str, scheme: str = SCHEME) -> str:
    """The ``WWW-Authenticate`` value of a refusal: the scheme and the cluster to sign for."""
    return f'{scheme} cluster="{cluster}"'


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


@dataclass(frozen=True)
class _Signed:
    """A parsed Authorization header: ``proof`` the MAC (hex) or the signature (raw bytes)."""

    scheme: str
    ts: str
    nonce: str
    proof: str | bytes
    operator: str = ""


def _parse(header: str) -> _Signed:
    """The fields of a header of either scheme, or AdminAuthError("malformed")."""
    scheme, sep, params = header.partition(" ")
    names = _FIELDS.get(scheme)
    if not sep or names is None:
        raise AdminAuthError("malformed")
    fields: dict[str, str] = {}
    for part in params.split(","):
        # The first '=' ends the name: a base64 signature ends in '='.
        name, eq, value = part.partition("=")
        if not eq or name not in names or name in fields:
            raise AdminAuthError("malformed")
        fields[name] = value
    if len(fields) != len(names):
        raise AdminAuthError("malformed")
    ts, nonce = fields["ts"], fields["nonce"]
    if not (_TS.fullmatch(ts) and _NONCE.fullmatch(nonce)):
        raise AdminAuthError("malformed")
    if scheme == SCHEME:
        if not _MAC.fullmatch(fields["mac"]):
            raise AdminAuthError("malformed")
        return _Signed(scheme, ts, nonce, fields["mac"])
    if not (_NAME.fullmatch(fields["name"]) and _SIG.fullmatch(fields["sig"])):
        raise AdminAuthError("malformed")
    try:
        sig = base64.b64decode(fields["sig"], validate=True)
    except binascii.Error:
        raise AdminAuthError("malformed") from None
    if len(sig) != SIGNATURE_BYTES:
        raise AdminAuthError("malformed")
    return _Signed(scheme, ts, nonce, sig, fields["name"])


class AdminVerifier:
    """Checks signed admin requests and remembers their nonces for the freshness window.

    ``operators`` (a callable follows reloads): when it lists anyone, only their
    ``MLXPP-ED25519`` signatures are accepted and an ``MLXPP-HMAC`` one is refused as
    ``operator_key_required``; when empty, ``key`` (the secret-derived key) verifies HMACs.

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
        operators: Operators | Callable[[], Operators] = NO_OPERATORS,
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
        self._operators = operators
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

    @property
    def operators(self) -> Operators:
        """Who may sign now (empty: legacy mode, the secret-derived key signs)."""
        listed = self._operators
        return listed if isinstance(listed, Operators) else listed()

    @property
    def scheme(self) -> str:
        """The scheme requests must be signed with now."""
        return ED25519_SCHEME if len(self.operators) else SCHEME

    def verify(self, header: str | None, method: str, path: str, body: bytes, *, host: str) -> str:
        """Accept the request (``host``: its Host header) and return the operator who signed
        it ("" for the cluster secret's HMAC), or raise AdminAuthError with the reason. Whether
        ``host`` names this server is the caller's check (``host_names_this_server``); the
        signature only proves the client signed that Host."""
        signed, operators = self._fresh(header)
        now = self._clock()
        stamp = int(signed.ts)
        request = canonical_request(
            method, path, signed.ts, signed.nonce, body, cluster=self.cluster_name, host=host
        )
        if isinstance(signed.proof, bytes):
            # An unknown name and a wrong signature are one refusal: names are not probed.
            message = operator_message(signed.operator, request)
            if not operators.verifies(signed.operator, message, signed.proof):
                raise AdminAuthError("bad_signature")
        elif not hmac.compare_digest(_mac(self._key, request), signed.proof):
            raise AdminAuthError("bad_mac")
        nonce = signed.nonce
        # Nonces are recorded only after the signature checks out: without a key nobody can
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
        return signed.operator

    def check_header(self, header: str | None) -> None:
        """What the header alone shows, before the body is read (AdminAuthError otherwise):
        present, well formed, its timestamp within the window. ``verify`` still checks all."""
        self._fresh(header)

    def _fresh(self, header: str | None) -> tuple[_Signed, Operators]:
        if not header:
            raise AdminAuthError("missing")
        if len(header) > MAX_HEADER_CHARS:
            raise AdminAuthError("malformed")
        signed = _parse(header)
        operators = self.operators
        # Once operators are listed, the secret every stage host holds signs nothing.
        if signed.scheme == SCHEME and len(operators):
            raise AdminAuthError("operator_key_required")
        if abs(self._clock() - int(signed.ts)) > self._window_s:
            raise AdminAuthError("stale")
        return signed, operators

    def _expire(self, now: float) -> None:
        # A nonce with timestamp ts can only come back while ts is within the window.
        while self._expiry and self._expiry[0][0] + self._window_s < now:
            _, nonce = heapq.heappop(self._expiry)
            self._seen.discard(nonce)
