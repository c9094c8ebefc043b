"""``mlxppctl tls self-signed``, the real CLI as a subprocess: it writes a certificate naming
every host (by default localhost, the loopback addresses and this machine's name) and its key
with mode 0600, prints the certificate's fingerprint exactly as the file hashes, refuses to
overwrite without --force, and the pair loads as a server's. Also: ``--cacert`` and
``--pin-sha256`` are refused, with a sentence, where they cannot act; ``mlxppd serve`` refuses
half a pair and a key others can read in one line, before the model loads."""

from __future__ import annotations

import hashlib
import ipaddress
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from mlxppd.app.http_site import server_context
from mlxppd.core.config.tls import TlsFiles
from tests.support.admin_server import SECRET
from tests.support.mlxppctl import clean_env, mlxppctl, one_line_error, write_secret


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path)


def _sans(cert: Path) -> set[str]:
    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    names = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = set(names.get_values_for_type(x509.DNSName))
    return dns | {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}


def test_self_signed_writes_the_pair_and_prints_its_fingerprint(
    tmp_path: Path, env: dict[str, str]
) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    proc = mlxppctl("tls", "self-signed", "--cert", str(cert), "--key", str(key), env=env)
    assert proc.returncode == 0, proc.stderr
    der = x509.load_pem_x509_certificate(cert.read_bytes()).public_bytes(Encoding.DER)
    assert proc.stdout == f"sha256:{hashlib.sha256(der).hexdigest()}\n"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" not in proc.stdout.encode() + proc.stderr.encode()
    expected = {"localhost", "127.0.0.1", "::1", socket.gethostname().lower()}
    assert _sans(cert) == expected
    server_context(TlsFiles(cert, key))  # the pair serves as it is


def test_hosts_and_days_are_as_asked(tmp_path: Path, env: dict[str, str]) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    proc = mlxppctl(
        "tls", "self-signed", "--cert", str(cert), "--key", str(key),
        "--host", "coordinator.lan", "--host", "10.0.0.1", "--host", "fd00::1", "--days", "30",
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert _sans(cert) == {"coordinator.lan", "10.0.0.1", str(ipaddress.ip_address("fd00::1"))}
    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    assert (loaded.not_valid_after_utc - loaded.not_valid_before_utc).days == 30


def test_existing_files_need_force(tmp_path: Path, env: dict[str, str]) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    args = ("tls", "self-signed", "--cert", str(cert), "--key", str(key))
    first = mlxppctl(*args, env=env).stdout
    line = one_line_error(mlxppctl(*args, env=env), 2)
    assert f"{cert} already exists; pass --force to replace it" in line
    second = mlxppctl(*args, "--force", env=env)
    assert second.returncode == 0 and second.stdout != first
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_tls_flags_on_a_plain_http_url_are_refused(tmp_path: Path, env: dict[str, str]) -> None:
    secret_file = write_secret(tmp_path / "cluster.secret", SECRET)
    proc = mlxppctl(
        "status", "--url", "http://127.0.0.1:9", "--cluster-secret-file", str(secret_file),
        "--pin-sha256", "sha256:" + "ab" * 32, env=env,
    )  # fmt: skip
    line = one_line_error(proc, 2)
    assert "--pin-sha256 has no effect on http://127.0.0.1:9, which is plain HTTP" in line


def test_a_malformed_pin_is_refused(tmp_path: Path, env: dict[str, str]) -> None:
    secret_file = write_secret(tmp_path / "cluster.secret", SECRET)
    proc = mlxppctl(
        "status", "--url", "https://127.0.0.1:9", "--cluster-secret-file", str(secret_file),
        "--pin-sha256", "ab12", env=env,
    )  # fmt: skip
    assert "--pin-sha256: takes a certificate fingerprint" in one_line_error(proc, 2)


def test_serve_refuses_half_a_pair_and_a_loose_key_at_once(
    tmp_path: Path, env: dict[str, str]
) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    assert mlxppctl("tls", "self-signed", "--cert", str(cert), "--key", str(key), env=env).stdout
    serve = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--pp-size", "2"]

    def refusal(*flags: str) -> str:
        proc = subprocess.run(
            [*serve, *flags], capture_output=True, text=True, env=env, timeout=120
        )
        assert proc.returncode == 2, proc.stderr
        [line] = proc.stderr.strip().splitlines()
        return line

    assert refusal("--tls-cert", str(cert)).startswith(
        "mlxppd: error: --tls-cert is set but --tls-key is not"
    )
    key.chmod(0o644)
    line = refusal("--tls-cert", str(cert), "--tls-key", str(key))
    assert f"the TLS key file {key} named by --tls-key is accessible to group or other" in line
