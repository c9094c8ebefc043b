"""How ``mlxppctl`` trusts an https:// server (no model; a real TLS listener on 127.0.0.1):
``--cacert`` with the server's certificate verifies; the right ``--pin-sha256`` is accepted
even where the name would not verify (``localhost`` is not in this certificate); a wrong pin is
refused before the request is sent, naming both fingerprints; neither flag means the system's
trust store, which does not know a self-signed certificate."""

from __future__ import annotations

import argparse
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from mlxppd.app.http_site import server_context
from mlxppd.cli.tls_client import PinMismatch, https_handler
from mlxppd.core.config.tls import TlsFiles
from mlxppd.core.errors import ConfigurationError
from tests.support.http import LoopThread
from tests.support.tls import TlsPair, write_pair

SEEN: list[str] = []


async def _hello(request: web.Request) -> web.Response:
    SEEN.append(request.path)
    return web.json_response({"ok": True})


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TlsPair:
    return write_pair(tmp_path_factory.mktemp("tls"), hosts=("127.0.0.1",))


@pytest.fixture(scope="module")
def port(pair: TlsPair) -> Iterator[int]:
    app = web.Application()
    app.router.add_get("/hello", _hello)
    loop = LoopThread("tls-client-test")
    try:
        url = loop.serve(app, tls=server_context(TlsFiles(pair.cert, pair.key)))
        yield int(url.rsplit(":", 1)[1])
    finally:
        loop.stop()


def _get(url: str, **flags: str | None) -> bytes:
    args = argparse.Namespace(cacert=flags.get("cacert"), pin_sha256=flags.get("pin_sha256"))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), https_handler(args))
    with opener.open(url, timeout=10) as response:
        body: bytes = response.read()
    return body


def test_the_ca_certificate_verifies(port: int, pair: TlsPair) -> None:
    assert _get(f"https://127.0.0.1:{port}/hello", cacert=str(pair.cert)) == b'{"ok": true}'


def test_the_right_pin_is_accepted_whatever_the_name(port: int, pair: TlsPair) -> None:
    assert _get(f"https://localhost:{port}/hello", pin_sha256=pair.pin.upper())


def test_a_wrong_pin_is_refused_before_the_request(port: int, pair: TlsPair) -> None:
    wrong = "sha256:" + "0" * 64
    SEEN.clear()
    with pytest.raises(urllib.error.URLError) as info:
        _get(f"https://127.0.0.1:{port}/wrong-pin", pin_sha256=wrong)
    assert isinstance(info.value.reason, PinMismatch)
    assert f"presented the certificate {pair.pin}, not {wrong}" in str(info.value.reason)
    assert "/wrong-pin" not in SEEN


def test_without_flags_the_system_store_refuses_a_self_signed_one(port: int) -> None:
    with pytest.raises(urllib.error.URLError) as info:
        _get(f"https://127.0.0.1:{port}/hello")
    assert isinstance(info.value.reason, ssl.SSLCertVerificationError)


def test_an_unreadable_cacert_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="^--cacert: cannot read the CA certificates"):
        https_handler(argparse.Namespace(cacert=str(tmp_path / "none.pem"), pin_sha256=None))
