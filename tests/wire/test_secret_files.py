"""Credential files: what a cluster secret must look like, and how secret and API key files are
opened (no link, mode 600, owned by the reader or root) unless explicitly allowed."""

from __future__ import annotations

import base64
import logging
import os
import secrets
from pathlib import Path

import pytest

from mlxppd.core.config.host import HostSettings, load_host_settings
from mlxppd.core.config.private_file import read_private_file
from mlxppd.core.errors import ConfigurationError
from mlxppd.wire.secret import load_cluster_secret, new_secret_text, secret_weakness

pytestmark = pytest.mark.timeout(60)


def write(path: Path, data: bytes | str, mode: int = 0o600) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    path.chmod(mode)
    return path


# --- the strength rule ---

STRONG = {
    "mlxppctl secret new": new_secret_text().encode(),
    "32 hex digits": secrets.token_hex(16).encode(),
    "upper-case hex": secrets.token_hex(32).upper().encode(),
    "openssl rand -base64 32": base64.b64encode(os.urandom(32)),
    "base64 wrapped in lines": base64.encodebytes(os.urandom(64)),
    "token_urlsafe(16)": secrets.token_urlsafe(16).encode(),
    "16 raw random bytes": b"\x8f\x03\xd1\xe2\x7a\xc4\x99\x10\xfe\x5b\x02\xa7\x31\xee\x64\xc8",
}

WEAK = {
    "hunter2": (b"hunter2", "7 characters, at most 42 bits"),
    "a passphrase": (b"correct horse battery staple", "neither hex nor base64"),
    "dashed words": (b"correct-horse-battery-staple", "lower-case words"),
    "run-together words": (b"correcthorsebatterystaplexyz", "lower-case words"),
    "a password": (b"Tr0ub4dor&3-is-my-password!", "neither hex nor base64"),
    "31 hex digits": (b"0123456789abcdef0123456789abcde", "31 hex digits, 124 bits"),
    "20 base64 chars": (b"Zm9vYmFyYmF6cXV4MTIz", "20 characters, at most 120 bits"),
    "bad base64 length": (b"Zm9vYmFyYmF6cXV4MTIzN", "not valid base64"),
    "15 raw bytes": (b"\x8f\x03\xd1\xe2\x7a\xc4\x99\x10\xfe\x5b\x02\xa7\x31\xee\x64", "15 bytes"),
    "a repeated digit": (b"0" * 64, "only 1 distinct characters"),
    "a short pattern": (b"abab" * 16, "only 2 distinct characters"),
    "bad base64 padding": (b"QUJDREVGR0hJSktMTU5PUFFSU1RVVldY=", "not valid base64"),
    "empty": (b"   \n", "empty"),
}


@pytest.mark.parametrize("value", STRONG.values(), ids=STRONG.keys())
def test_random_secrets_in_every_documented_form_are_accepted(value: bytes) -> None:
    assert secret_weakness(value.strip()) is None


@pytest.mark.parametrize(("value", "why"), WEAK.values(), ids=WEAK.keys())
def test_passwords_and_short_or_patterned_values_are_refused(
    value: bytes, why: str, tmp_path: Path
) -> None:
    assert why in (secret_weakness(value.strip()) or "")
    path = write(tmp_path / "cluster.secret", value)
    with pytest.raises(ConfigurationError) as info:
        load_cluster_secret(flag_path=path, environ={})
    message = str(info.value)
    assert f"the cluster secret from --cluster-secret-file ({path}) is too weak" in message
    assert "`mlxppctl secret new PATH`" in message
    if value.strip():
        assert value.strip().decode(errors="replace") not in message


def test_a_weak_value_in_the_environment_names_the_variable() -> None:
    with pytest.raises(ConfigurationError, match="from MLXPP_CLUSTER_SECRET is too weak"):
        load_cluster_secret(environ={"MLXPP_CLUSTER_SECRET": "hunter2"})


def test_no_random_secret_is_refused_by_chance() -> None:
    # Raw bytes lose surrounding whitespace bytes like any secret, hence 32 of them here.
    for _ in range(300):
        for value in (
            secrets.token_hex(16).encode(),
            secrets.token_urlsafe(16).encode(),
            base64.b64encode(os.urandom(16)),
            os.urandom(32),
        ):
            assert secret_weakness(value.strip()) is None, value


# --- the permission rule ---


def read(path: Path, allow_loose: bool = False) -> bytes:
    return read_private_file(path, what="the test file", named_by="--flag", allow_loose=allow_loose)


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700])
def test_a_file_only_its_owner_can_use_is_read(tmp_path: Path, mode: int) -> None:
    assert read(write(tmp_path / "f", b"data", mode)) == b"data"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660, 0o601])
def test_any_access_for_group_or_others_is_refused_with_the_chmod_fix(
    tmp_path: Path, mode: int
) -> None:
    path = write(tmp_path / "f", b"data", mode)
    with pytest.raises(ConfigurationError) as info:
        read(path)
    message = str(info.value)
    assert f"the test file {path} named by --flag" in message
    assert f"(mode {mode:04o}); run `chmod 600 {path}`" in message
    assert "--allow-loose-secret-file" in message and "MLXPP_ALLOW_LOOSE_SECRET_FILE=1" in message


def test_the_override_reads_a_loose_file_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "f", b"data", 0o644)
    with caplog.at_level(logging.WARNING):
        assert read(path, allow_loose=True) == b"data"
    assert "chmod 600" in caplog.text and "--allow-loose-secret-file" in caplog.text


def test_a_file_of_another_user_is_refused_with_the_chown_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "f", b"data")
    if os.geteuid() == 0:
        os.chown(path, 1234, -1)  # root owns it otherwise, and a root-owned file is fine
    owner = path.stat().st_uid
    reader = 4242 if owner != 4242 else 4343
    monkeypatch.setattr(os, "geteuid", lambda: reader)
    with pytest.raises(ConfigurationError) as info:
        read(path)
    message = str(info.value)
    assert f"(uid {owner})" in message and f"(uid {reader})" in message
    assert f"chown {reader} {path}`" in message or "sudo chown" in message
    assert read(path, allow_loose=True) == b"data"


def test_root_reads_a_file_of_any_owner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "f", b"data")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert read(path) == b"data"


def test_a_file_owned_by_root_is_read_by_anyone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "f", b"data")
    if path.stat().st_uid != 0:
        pytest.skip("needs root to make a root-owned file")
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    assert read(path) == b"data"


def test_a_symbolic_link_is_not_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = write(tmp_path / "real", b"data")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ConfigurationError) as info:
        read(link)
    message = str(info.value)
    assert f"the test file {link} named by --flag is a symbolic link" in message
    assert f"readlink -f {link}" in message
    with caplog.at_level(logging.WARNING):
        assert read(link, allow_loose=True) == b"data"
    assert "symbolic link" in caplog.text


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_something_other_than_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "thing"
    if kind == "directory":
        path.mkdir(mode=0o700)
    else:
        os.mkfifo(path, 0o600)  # a FIFO with no writer must not hang the read
    with pytest.raises(ConfigurationError, match="is not a regular file"):
        read(path)


def test_a_huge_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="larger than 64 KiB"):
        read(write(tmp_path / "f", b"x" * (64 * 1024 + 1)))


def test_a_missing_file_names_the_file_and_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as info:
        read(tmp_path / "nope")
    assert f"cannot read the test file {tmp_path / 'nope'} named by --flag" in str(info.value)


def test_the_cluster_secret_file_obeys_the_rule_in_every_source(tmp_path: Path) -> None:
    path = write(tmp_path / "cluster.secret", new_secret_text(), 0o644)
    for kwargs in (
        {"flag_path": path, "environ": {}},
        {"environ": {"MLXPP_CLUSTER_SECRET_FILE": str(path)}},
        {"environ": {}, "config_secret_file": str(path)},
    ):
        with pytest.raises(ConfigurationError, match="chmod 600"):
            load_cluster_secret(**kwargs)  # type: ignore[arg-type]


# --- the API key file ---

KEY = "sk-mlxpp-0123456789abcdef"


def test_api_key_file_reads_the_key_relative_to_the_config_dir(tmp_path: Path) -> None:
    write(tmp_path / "api.key", KEY + "\n")
    (tmp_path / "mlxppd.toml").write_text('api_key_file = "api.key"\n')
    host = load_host_settings(tmp_path, environ={})
    assert host.api_key == KEY
    assert KEY not in repr(host) and KEY not in str(host)


def test_api_key_file_may_come_from_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path / "api.key", KEY)
    host = load_host_settings(tmp_path, environ={"MLXPP_API_KEY_FILE": str(path)})
    assert host.api_key == KEY


def test_api_key_file_obeys_the_secret_file_rule(tmp_path: Path) -> None:
    path = write(tmp_path / "api.key", KEY, 0o644)
    (tmp_path / "mlxppd.toml").write_text(f'api_key_file = "{path}"\n')
    with pytest.raises(ConfigurationError) as info:
        load_host_settings(tmp_path, environ={})
    message = str(info.value)
    assert f"the API key file {path} named by api_key_file" in message
    assert f"chmod 600 {path}" in message and KEY not in message
    loose = {"MLXPP_ALLOW_LOOSE_SECRET_FILE": "1"}
    assert load_host_settings(tmp_path, environ=loose).api_key == KEY


def test_api_key_and_api_key_file_together_are_refused(tmp_path: Path) -> None:
    write(tmp_path / "api.key", KEY)
    (tmp_path / "mlxppd.toml").write_text('api_key_file = "api.key"\n')
    with pytest.raises(ConfigurationError, match="api_key and api_key_file are both set"):
        load_host_settings(tmp_path, environ={"MLXPP_API_KEY": "other"})


@pytest.mark.parametrize("content", [b"", b"\n\n", b"two\nlines", b"\xff\xfe"])
def test_an_api_key_file_without_one_printable_line_is_refused(
    tmp_path: Path, content: bytes
) -> None:
    write(tmp_path / "api.key", content)
    (tmp_path / "mlxppd.toml").write_text('api_key_file = "api.key"\n')
    with pytest.raises(ConfigurationError, match="one line of printable ASCII"):
        load_host_settings(tmp_path, environ={})


def test_the_api_key_is_never_in_a_repr() -> None:
    assert "sk-secret" not in repr(HostSettings(api_key="sk-secret"))
