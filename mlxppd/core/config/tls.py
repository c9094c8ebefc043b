"""HTTPS on the coordinator's HTTP listeners: the certificate and key files, and their checks.

``mlxppd serve --tls-cert FILE --tls-key FILE`` (or ``tls_cert_file`` / ``tls_key_file`` in
``mlxppd.toml``) turns TLS on for the API, the admin API, the console and ``--metrics-port``.
Both are given or neither. The certificate file is PEM (the server's certificate first, then
any intermediates); the key file is an unencrypted PEM private key, read by the rule of
``mlxppd.core.config.private_file`` (mode 600, no link, owned by the reader or root). Each
problem is one sentence naming the file and the fix; the key's bytes never appear in one.
``mlxppd.app.http_site.server_context`` turns checked files into the listener's context:
TLS 1.2 is the minimum and 1.3 is chosen whenever the client offers it (OpenSSL picks the
highest version both sides speak); every TLS 1.2 cipher Python allows by default is an ECDHE
or DHE one, so a recorded session stays sealed even if the key file leaks later.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from mlxppd.core.config.private_file import FileRefused, open_regular_file, read_private_file
from mlxppd.core.errors import ConfigurationError

__all__ = [
    "CERT_FLAG",
    "KEY_FLAG",
    "MAKE_ONE",
    "TlsFiles",
    "check_tls_files",
    "fingerprint",
    "parse_pin",
    "tls_files",
]

log = logging.getLogger(__name__)

CERT_FLAG = "--tls-cert"
KEY_FLAG = "--tls-key"
#: a certificate chain is a few KiB; never read a huge file as one
MAX_CERT_BYTES = 256 * 1024
MAKE_ONE = "`mlxppctl tls self-signed --cert CERT --key KEY` makes a pair"
_PIN = re.compile(r"sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class TlsFiles:
    """The certificate and key files of an HTTPS listener, and where each was named."""

    cert: Path
    key: Path
    cert_named_by: str = CERT_FLAG
    key_named_by: str = KEY_FLAG
    #: a key file failing the permission rule is used with a warning (--allow-loose-secret-file)
    allow_loose: bool = False


def tls_files(
    cert: str | Path | None,
    key: str | Path | None,
    *,
    cert_named_by: str = CERT_FLAG,
    key_named_by: str = KEY_FLAG,
    allow_loose: bool = False,
    base_dir: Path | None = None,
) -> TlsFiles | None:
    """The pair, or None when neither is given; one without the other is an error.

    A relative path is relative to ``base_dir`` when given (the config directory)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = (
            (cert_named_by, key_named_by) if key is None else (key_named_by, cert_named_by)
        )
        raise ConfigurationError(
            f"{given} is set but {missing} is not, and HTTPS needs both the certificate and its "
            f"key; set {missing} too, or drop {given} to serve plain HTTP"
        )

    def resolved(path: str | Path) -> Path:
        path = Path(path).expanduser()
        return base_dir / path if base_dir is not None and not path.is_absolute() else path

    return TlsFiles(resolved(cert), resolved(key), cert_named_by, key_named_by, allow_loose)


def fingerprint(der: bytes) -> str:
    """A certificate's SHA-256 fingerprint as ``sha256:<64 lower-case hex digits>``."""
    return "sha256:" + hashlib.sha256(der).hexdigest()


def parse_pin(text: str, *, source: str = "--pin-sha256") -> str:
    """``sha256:<hex>`` (any case, colons between bytes allowed) in the form ``fingerprint``
    prints, or a ConfigurationError naming ``source``."""
    canonical = "sha256:" + text.strip().lower().removeprefix("sha256:").replace(":", "")
    if not _PIN.fullmatch(canonical):
        raise ConfigurationError(
            "takes a certificate fingerprint, sha256: and 64 hex digits, as `mlxppctl tls "
            "self-signed` prints it (or `openssl x509 -in CERT -noout -fingerprint -sha256`)",
            source=source,
        )
    return canonical


def _read_cert(files: TlsFiles) -> tuple[bytes, x509.Certificate]:
    where = f"the TLS certificate file {files.cert} named by {files.cert_named_by}"
    try:
        # A certificate is public (a link is fine), but a FIFO or a device must not hang the start.
        fd, _ = open_regular_file(files.cert, follow_links=True)
        with os.fdopen(fd, "rb") as f:
            pem = f.read(MAX_CERT_BYTES + 1)
    except FileRefused:
        raise ConfigurationError(
            f"{where} is not a regular file; point {files.cert_named_by} at the certificate file"
        ) from None
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read {where}: {exc.strerror or exc}; point {files.cert_named_by} at a PEM "
            f"certificate ({MAKE_ONE})"
        ) from None
    try:
        chain = x509.load_pem_x509_certificates(pem)
    except ValueError:
        chain = []
    if len(pem) > MAX_CERT_BYTES or not chain:
        raise ConfigurationError(
            f"{where} holds no PEM certificate (-----BEGIN CERTIFICATE-----); point "
            f"{files.cert_named_by} at the certificate, not the key ({MAKE_ONE})"
        )
    return pem, chain[0]


def _check_key(files: TlsFiles, cert: x509.Certificate) -> None:
    where = f"the TLS key file {files.key} named by {files.key_named_by}"
    pem = read_private_file(
        files.key,
        what="the TLS key file",
        named_by=files.key_named_by,
        allow_loose=files.allow_loose,
    )
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except TypeError:
        raise ConfigurationError(
            f"{where} is encrypted, and a server starting unattended has no one to type its "
            "passphrase; write it unencrypted (`openssl pkey -in KEY -out KEY.plain`), mode 600"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigurationError(
            f"{where} holds no PEM private key (-----BEGIN PRIVATE KEY-----); point "
            f"{files.key_named_by} at the key, not the certificate ({MAKE_ONE})"
        ) from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise ConfigurationError(
            f"{where} is not the key of the certificate in {files.cert} (named by "
            f"{files.cert_named_by}); give the key that certificate was made for, or make a "
            f"new pair ({MAKE_ONE})"
        )


def check_tls_files(files: TlsFiles) -> None:
    """Read both files as a server will: every problem is a ConfigurationError naming the file
    and the fix; an expired certificate is a warning (clients will say so too)."""
    _, cert = _read_cert(files)
    _check_key(files, cert)  # the permission rule, and a key that matches the certificate
    if cert.not_valid_after_utc < datetime.now(UTC):
        log.warning(
            "the TLS certificate %s expired on %s: clients will refuse it until it is renewed",
            files.cert,
            cert.not_valid_after_utc.date().isoformat(),
        )
