"""``mlxppctl tls self-signed --cert FILE --key FILE``: a certificate and key for HTTPS.

The pair is for ``mlxppd serve --tls-cert FILE --tls-key FILE`` (docs/security.md, "HTTPS"):
an ECDSA P-256 key (mode 0600) and a self-signed certificate naming every ``--host`` (default:
localhost, 127.0.0.1, ::1 and this machine's hostname). Clients trust it by its file
(``--cacert``) or by the SHA-256 fingerprint this prints (``mlxppctl ... --pin-sha256``).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mlxppd.cli.common import command_group
from mlxppd.core.config.private_file import write_private_file
from mlxppd.core.config.tls import fingerprint
from mlxppd.core.errors import ConfigurationError

__all__ = ["DEFAULT_DAYS", "default_hosts", "register", "self_signed"]

DEFAULT_DAYS = 825  # the longest validity Apple platforms accept for a TLS server certificate
_MAX_DAYS = 3650


def default_hosts() -> tuple[str, ...]:
    """localhost, the loopback addresses and this machine's hostname (when it has one)."""
    hosts = ["localhost", "127.0.0.1", "::1"]
    name = socket.gethostname().strip()
    if name and name not in hosts:
        hosts.append(name)
    return tuple(hosts)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    try:
        return x509.DNSName(host.encode("idna").decode("ascii").lower())
    except UnicodeError:
        raise ConfigurationError(
            f"{host!r} is neither an IP address nor a host name; give a name such as "
            "coordinator.lan or an address such as 10.0.0.1",
            source="--host",
        ) from None


def self_signed(hosts: Sequence[str], days: int) -> tuple[bytes, bytes]:
    """A fresh (certificate PEM, unencrypted PKCS#8 key PEM) for ``hosts``, valid ``days``."""
    if not 1 <= days <= _MAX_DAYS:
        raise ConfigurationError(f"use a number of days from 1 to {_MAX_DAYS}", source="--days")
    if not hosts:
        raise ConfigurationError("give at least one host name or address", source="--host")
    names = list(dict.fromkeys(_san(h) for h in hosts))
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0][:64])])
    # A minute back: a client whose clock is a little behind still accepts it at once.
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=1)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def register(subparsers: Any) -> None:
    sub = command_group(
        subparsers,
        "tls",
        help="make a certificate for the coordinator's HTTPS",
        description="Certificates for the coordinator's HTTPS listeners (mlxppd serve "
        "--tls-cert/--tls-key, tls_cert_file/tls_key_file in mlxppd.toml).",
        dest="tls_command",
    )
    new = sub.add_parser(
        "self-signed",
        help="write a self-signed certificate and its key",
        description="Write a self-signed certificate for every --host to --cert and its "
        "unencrypted private key (ECDSA P-256) to --key with mode 0600, then print the "
        "certificate's SHA-256 fingerprint (sha256:<hex>). Clients trust it by the file "
        "(mlxppctl --cacert, curl --cacert) or by that fingerprint (mlxppctl --pin-sha256).",
    )
    new.add_argument("--cert", required=True, type=Path, metavar="FILE", help="certificate (PEM)")
    new.add_argument("--key", required=True, type=Path, metavar="FILE", help="key (PEM, 0600)")
    new.add_argument(
        "--host",
        action="append",
        metavar="NAME",
        help="a host name or IP address clients reach the coordinator by (repeatable; default: "
        "localhost, 127.0.0.1, ::1 and this machine's hostname)",
    )
    new.add_argument(
        "--days",
        type=int,
        default=DEFAULT_DAYS,
        help=f"days the certificate is valid (default {DEFAULT_DAYS})",
    )
    new.add_argument("--force", action="store_true", help="replace files that exist")
    new.set_defaults(func=_self_signed)


def _self_signed(args: argparse.Namespace) -> int:
    hosts = tuple(args.host) if args.host else default_hosts()
    cert_pem, key_pem = self_signed(hosts, args.days)
    if not args.force:
        for path in (args.cert, args.key):
            if path.exists():
                raise ConfigurationError(f"{path} already exists; pass --force to replace it")
    # The key first: a certificate on disk is useless without it, and it must never be loose.
    write_private_file(
        args.key,
        key_pem,
        what="the TLS key file",
        force=args.force,
        replaced="the coordinator then needs the new certificate too",
    )
    try:
        args.cert.write_bytes(cert_pem)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot write the certificate file {args.cert}: {exc.strerror or exc}"
        ) from None
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    print(fingerprint(der))
    print(
        f"wrote {args.cert} (for {', '.join(hosts)}; {args.days} days) and its key {args.key} "
        f"(mode 0600); serve with --tls-cert {args.cert} --tls-key {args.key}",
        file=sys.stderr,
    )
    return 0
