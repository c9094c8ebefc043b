"""HTTPS certificate and key files: a good pair loads into a TLS 1.2+ server context; every bad
one is one sentence naming the file and the fix, with the key's bytes in none of them; both or
neither (flags and mlxppd.toml); the TOML's relative paths are in the config directory."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest

from mlxppd.app.http_site import server_context
from mlxppd.core.config.host import host_tls_files, load_host_settings
from mlxppd.core.config.tls import TlsFiles, parse_pin, tls_files
from mlxppd.core.errors import ConfigurationError
from tests.support.tls import TlsPair, write_pair

BOTH = 'tls_cert_file = "server.crt"\ntls_key_file = "server.key"\n'


@pytest.fixture()
def pair(tmp_path: Path) -> TlsPair:
    return write_pair(tmp_path)


def refused(files: TlsFiles) -> str:
    with pytest.raises(ConfigurationError) as info:
        server_context(files)
    message = str(info.value)
    assert "\n" not in message
    if files.key.is_file():  # the key's bytes are in no error
        body = [line for line in files.key.read_text().splitlines() if "-----" not in line]
        assert not any(line in message for line in body)
    return message


def test_a_good_pair_loads_with_tls_1_2_at_least(pair: TlsPair) -> None:
    context = server_context(TlsFiles(pair.cert, pair.key))
    assert context.minimum_version is ssl.TLSVersion.TLSv1_2
    assert context.verify_mode is ssl.CERT_NONE  # clients are not asked for certificates


def test_a_missing_certificate_names_the_file_and_how_to_make_one(
    pair: TlsPair, tmp_path: Path
) -> None:
    message = refused(TlsFiles(tmp_path / "nope.crt", pair.key))
    assert (
        f"cannot read the TLS certificate file {tmp_path / 'nope.crt'} named by --tls-cert"
        in message
    )
    assert "No such file or directory" in message and "mlxppctl tls self-signed" in message


def test_a_missing_key_names_the_file(pair: TlsPair, tmp_path: Path) -> None:
    message = refused(TlsFiles(pair.cert, tmp_path / "nope.key"))
    assert f"the TLS key file {tmp_path / 'nope.key'} named by --tls-key" in message


def test_a_key_others_can_read_is_refused_like_a_cluster_secret(pair: TlsPair) -> None:
    pair.key.chmod(0o644)
    message = refused(TlsFiles(pair.cert, pair.key))
    assert "accessible to group or other users (mode 0644)" in message
    assert f"chmod 600 {pair.key}" in message
    # --allow-loose-secret-file turns the refusal into a warning, as for the secret.
    server_context(TlsFiles(pair.cert, pair.key, allow_loose=True))


def test_a_key_that_is_a_link_is_refused(pair: TlsPair, tmp_path: Path) -> None:
    link = tmp_path / "link.key"
    link.symlink_to(pair.key)
    assert "is a symbolic link" in refused(TlsFiles(pair.cert, link))


def test_swapped_files_say_which_is_which(pair: TlsPair) -> None:
    swapped = pair.cert.parent / "swapped.key"
    swapped.write_bytes(pair.cert.read_bytes())
    swapped.chmod(0o600)
    assert "holds no PEM private key" in refused(TlsFiles(pair.cert, swapped))
    assert "holds no PEM certificate" in refused(TlsFiles(pair.key, pair.key))


def test_a_key_of_another_certificate_is_a_mismatch(pair: TlsPair, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    stranger = write_pair(other)
    message = refused(TlsFiles(pair.cert, stranger.key))
    assert f"{stranger.key} named by --tls-key is not the key of the certificate in " in message
    assert str(pair.cert) in message


def test_an_encrypted_key_asks_for_an_unencrypted_one(pair: TlsPair) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pair.key.read_bytes(), password=None)
    pair.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    assert "is encrypted" in refused(TlsFiles(pair.cert, pair.key))


def test_both_or_neither() -> None:
    assert tls_files(None, None) is None
    with pytest.raises(ConfigurationError) as info:
        tls_files("server.crt", None)
    assert str(info.value).startswith("--tls-cert is set but --tls-key is not")


def test_the_toml_paths_are_in_the_config_directory(tmp_path: Path) -> None:
    pair = write_pair(tmp_path)
    (tmp_path / "mlxppd.toml").write_text(
        'tls_cert_file = "server.crt"\ntls_key_file = "server.key"\n'
    )
    settings = load_host_settings(tmp_path, environ={})
    assert host_tls_files(settings, allow_loose=False) == TlsFiles(
        pair.cert, pair.key, "tls_cert_file", "tls_key_file"
    )


def test_a_bad_toml_pair_fails_the_load_naming_the_key(tmp_path: Path) -> None:
    write_pair(tmp_path)
    (tmp_path / "mlxppd.toml").write_text('tls_cert_file = "server.crt"\n')
    with pytest.raises(ConfigurationError) as info:
        load_host_settings(tmp_path, environ={})
    assert str(info.value).startswith(f"tls_cert_file in {tmp_path / 'mlxppd.toml'} is set")
    (tmp_path / "server.key").chmod(0o640)
    (tmp_path / "mlxppd.toml").write_text(
        'tls_cert_file = "server.crt"\ntls_key_file = "server.key"\n'
    )
    with pytest.raises(ConfigurationError, match="named by tls_key_file in .*mode 0640"):
        load_host_settings(tmp_path, environ={})


@pytest.mark.parametrize(
    "text", ["sha256:" + "AB" * 32, "AB:" * 31 + "AB", "sha256:" + ":".join(["ab"] * 32)]
)
def test_a_pin_is_read_in_the_printed_form(text: str) -> None:
    assert parse_pin(text) == "sha256:" + "ab" * 32


@pytest.mark.parametrize("text", ["sha1:" + "ab" * 20, "sha256:" + "ab" * 31, "sha256:zz"])
def test_a_bad_pin_is_refused(text: str) -> None:
    with pytest.raises(ConfigurationError, match="^--pin-sha256: takes a certificate fingerprint"):
        parse_pin(text)


def test_a_certificate_path_that_is_no_file_is_refused(pair: TlsPair, tmp_path: Path) -> None:
    fifo = tmp_path / "cert.fifo"
    os.mkfifo(fifo)  # would block a plain open(); refused at once instead
    assert "is not a regular file" in refused(TlsFiles(fifo, pair.key))
