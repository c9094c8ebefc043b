"""A certificate and key for a test's HTTPS listener, made as ``mlxppctl tls self-signed`` does."""

from __future__ import annotations

import http.client
import ssl
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from mlxppd.cli.ctl_tls import self_signed
from mlxppd.core.config.tls import fingerprint


@dataclass(frozen=True)
class TlsPair:
    cert: Path
    key: Path
    #: sha256:<hex> of the certificate
    pin: str

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this certificate alone (chain and host name checked)."""
        return ssl.create_default_context(cafile=str(self.cert))


def write_pair(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> TlsPair:
    cert_pem, key_pem = self_signed(hosts, 2)
    cert, key = directory / "server.crt", directory / "server.key"
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    key.chmod(0o600)
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(Encoding.DER)
    return TlsPair(cert, key, fingerprint(der))


def assert_plain_http_gets_no_answer(port: int) -> None:
    """A plain-HTTP request to a TLS port on 127.0.0.1 fails: no HTTP answer comes back."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            conn.request("GET", "/health")
            conn.getresponse()
    finally:
        conn.close()
