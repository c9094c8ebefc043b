"""How ``mlxppctl`` trusts an ``https://`` coordinator: ``--cacert``, ``--pin-sha256``, or the
system's trust store.

``--cacert FILE`` verifies the certificate chain and host name against the certificates in
FILE alone. ``--pin-sha256 sha256:<hex>`` accepts exactly the certificate with that
fingerprint, whatever its issuer or names (a self-signed one, reached by any address); the
fingerprint is compared right after the handshake, before a byte of the request is sent, so a
signed request never reaches another server. Without either, the system's trust store verifies.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import ssl
import urllib.request
from typing import Any

from mlxppd.core.config.tls import fingerprint, parse_pin
from mlxppd.core.errors import ConfigurationError

__all__ = ["PinMismatch", "add_tls_flags", "https_handler"]


class PinMismatch(OSError):
    """The server's certificate is not the pinned one (an OSError: urllib wraps it as one)."""


def add_tls_flags(group: argparse._ArgumentGroup) -> None:
    """``--cacert`` and ``--pin-sha256``, one or the other."""
    choice = group.add_mutually_exclusive_group()
    choice.add_argument(
        "--cacert",
        metavar="FILE",
        help="for an https:// coordinator: trust the certificates in FILE (PEM) instead of the "
        "system's trust store",
    )
    choice.add_argument(
        "--pin-sha256",
        metavar="sha256:HEX",
        help="for an https:// coordinator: accept exactly the certificate with this SHA-256 "
        "fingerprint (as `mlxppctl tls self-signed` prints it), whatever its issuer",
    )


class _PinnedConnection(http.client.HTTPSConnection):
    def __init__(self, *args: Any, pin: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pin = pin

    def connect(self) -> None:
        super().connect()
        der = self.sock.getpeercert(binary_form=True) if self.sock is not None else None
        got = fingerprint(der) if der else "no certificate"
        if got != self.pin:
            self.close()
            raise PinMismatch(
                f"the server presented the certificate {got}, not {self.pin} pinned by "
                "--pin-sha256; if the coordinator's certificate was replaced, pin the new one"
            )


class _PinnedHandler(urllib.request.HTTPSHandler):
    def __init__(self, pin: str) -> None:
        # The pin stands in for the chain and the name: verify neither, compare the fingerprint.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        super().__init__(context=context)
        self._pin = pin
        self._tls = context

    def https_open(self, req: urllib.request.Request) -> Any:
        connection = functools.partial(_PinnedConnection, pin=self._pin)
        return self.do_open(connection, req, context=self._tls)


def https_handler(args: argparse.Namespace) -> urllib.request.HTTPSHandler:
    """The handler ``--cacert`` / ``--pin-sha256`` ask for (neither: the system's store)."""
    if getattr(args, "pin_sha256", None):
        return _PinnedHandler(parse_pin(args.pin_sha256))
    cacert = getattr(args, "cacert", None)
    if cacert:
        try:
            context = ssl.create_default_context(cafile=cacert)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(
                f"cannot read the CA certificates in {cacert}: "
                f"{getattr(exc, 'strerror', None) or getattr(exc, 'reason', None) or exc}; "
                "point --cacert at a PEM certificate file (the coordinator's own, for a "
                "self-signed one)",
                source="--cacert",
            ) from None
        return urllib.request.HTTPSHandler(context=context)
    return urllib.request.HTTPSHandler(context=ssl.create_default_context())
