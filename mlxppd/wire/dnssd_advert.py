"""The signed TXT record of a node's DNS-SD advertisement (``_mlxpp._tcp.local.``).

Every agent advertises itself on multicast DNS (``runtime/system/dnssd.py``) so that
``dns-sd -B _mlxpp._tcp`` on a Mac, ``avahi-browse _mlxpp._tcp`` on Linux and ``mlxppctl
discover`` see it. Anyone on the link can advertise anything, so the TXT record carries a MAC:
HMAC-SHA256, keyed by HKDF of the cluster secret (another HKDF label than the UDP beacons',
``wire/discovery.py``: neither key opens anything else), over the service instance name, its
port and every other property in a canonical order. A browser bounds the record's size before
reading it and checks the MAC before believing any field; what fails is ignored and counted by
reason. The timestamp bounds how long a recorded advertisement can be replayed.

TXT properties (each a DNS-SD key of at most 9 bytes and a value of at most 255)::

    v=1 id=<node id> cl=<cluster name> mem=<free bytes> acc=<accelerator> ver=<mlxpp version>
    ts=<unix seconds> sig=<64 hex>
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "ADVERT_VERSION",
    "MAX_ADVERT_AGE_S",
    "SERVICE_TYPE",
    "Advert",
    "AdvertRejectReason",
    "AdvertRejected",
    "advert_key",
    "advert_properties",
    "instance_name",
    "verify_advert",
]

SERVICE_TYPE = "_mlxpp._tcp.local."
ADVERT_VERSION = 1
#: seconds an advertisement stays believable (advertisers refresh well within it)
MAX_ADVERT_AGE_S = 120.0
#: a real record has 8 properties of a few dozen bytes; more than this is refused unread
_MAX_PROPERTIES = 16
_MAX_VALUE_BYTES = 255
_FIELDS = ("v", "id", "cl", "mem", "acc", "ver", "ts")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_TEXT = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._+/()-]{0,63}")
_HKDF_SALT = b"mlxpp discovery"
_HKDF_INFO = b"mlxpp dns-sd v1"

AdvertRejectReason = Literal["oversize", "malformed", "unsigned", "bad_mac", "foreign", "stale"]


class AdvertRejected(Exception):
    def __init__(self, reason: AdvertRejectReason, detail: str) -> None:
        super().__init__(detail)
        self.reason: AdvertRejectReason = reason


@dataclass(frozen=True)
class Advert:
    """What a node says of itself; believed only once its MAC is checked."""

    node_id: str
    cluster: str
    #: the agent's control port (the TCP port the service points at)
    port: int
    #: bytes of memory free on the host when it advertised
    free_memory_bytes: int
    #: e.g. "metal", "cuda", "cpu"
    accelerator: str
    #: the mlxpp package version
    version: str
    #: unix seconds when it was signed
    signed_at: int


def advert_key(secret: bytes) -> bytes:
    """The 32-byte MAC key of advertisements, derived from the cluster secret."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_HKDF_SALT, info=_HKDF_INFO).derive(
        secret
    )


def instance_name(node_id: str, cluster: str) -> str:
    """The service instance's full name: one per node and cluster on a link."""
    return f"{node_id}.{cluster}.{SERVICE_TYPE}"


def _signed_text(name: str, port: int, fields: Mapping[str, str]) -> bytes:
    lines = [f"name={name}", f"port={port}", *(f"{k}={fields[k]}" for k in _FIELDS)]
    return "\n".join(lines).encode()


def advert_properties(advert: Advert, key: bytes) -> dict[str, str]:
    """The TXT properties of ``advert``, signed with ``key``; ValueError for a field that
    could not be advertised."""
    if not _NAME.fullmatch(advert.node_id) or not _NAME.fullmatch(advert.cluster):
        raise ValueError("a node id and a cluster name are 1-63 letters, digits, '.', '_', '-'")
    if not _TEXT.fullmatch(advert.accelerator) or not _TEXT.fullmatch(advert.version):
        raise ValueError("an accelerator and a version are short plain text")
    fields = {
        "v": str(ADVERT_VERSION), "id": advert.node_id, "cl": advert.cluster,
        "mem": str(max(0, advert.free_memory_bytes)), "acc": advert.accelerator,
        "ver": advert.version, "ts": str(advert.signed_at),
    }  # fmt: skip
    name = instance_name(advert.node_id, advert.cluster)
    mac = hmac.new(key, _signed_text(name, advert.port, fields), "sha256").hexdigest()
    return {**fields, "sig": mac}


def _text(raw: bytes | None, what: str) -> str:
    if raw is None or len(raw) > _MAX_VALUE_BYTES:
        raise AdvertRejected("malformed", f"{what} is missing or too long")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise AdvertRejected("malformed", f"{what} is not ASCII") from None


def verify_advert(
    name: str,
    port: int,
    properties: Mapping[bytes, bytes | None],
    key: bytes,
    *,
    cluster: str,
    now: float,
    max_age_s: float = MAX_ADVERT_AGE_S,
) -> Advert:
    """The advertisement of service ``name`` on ``port`` with ``properties``, once its MAC,
    its cluster and its age are checked; ``AdvertRejected`` names why not."""
    if len(properties) > _MAX_PROPERTIES or len(name) > 255:
        raise AdvertRejected("oversize", f"{len(properties)} properties")
    if b"sig" not in properties:
        raise AdvertRejected("unsigned", "no sig property")
    sig = _text(properties[b"sig"], "sig")
    fields = {k: _text(properties.get(k.encode()), k) for k in _FIELDS}
    if not 0 < port < 65536:
        raise AdvertRejected("malformed", f"port {port}")
    want = hmac.new(key, _signed_text(name, port, fields), "sha256").hexdigest()
    if not hmac.compare_digest(sig.encode(), want.encode()):
        raise AdvertRejected("bad_mac", "the signature does not match")
    # Signed by a holder of the secret from here on: the fields are what that node said.
    if name != instance_name(fields["id"], fields["cl"]):
        raise AdvertRejected("malformed", "the service name is not its node's")
    if fields["cl"] != cluster:
        raise AdvertRejected("foreign", f"cluster {fields['cl']!r}")
    try:
        signed_at, memory = int(fields["ts"]), int(fields["mem"])
    except ValueError:
        raise AdvertRejected("malformed", "ts or mem is not a number") from None
    if abs(now - signed_at) > max_age_s:
        raise AdvertRejected("stale", f"signed {now - signed_at:.0f} s ago")
    if fields["v"] != str(ADVERT_VERSION):
        raise AdvertRejected("malformed", f"version {fields['v']!r}")
    return Advert(
        node_id=fields["id"], cluster=fields["cl"], port=port, free_memory_bytes=memory,
        accelerator=fields["acc"], version=fields["ver"], signed_at=signed_at,
    )  # fmt: skip
