"""The cluster secret: lookup order, start-up errors that list every source, new secret files."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from mlxppd.cli.mlxppctl_main import main as mlxppctl
from mlxppd.core.errors import ConfigurationError
from mlxppd.wire.secret import (
    SECRET_SOURCES,
    ClusterSecret,
    SecretSource,
    load_cluster_secret,
    resolve_secret_source,
    write_new_secret,
)

pytestmark = pytest.mark.timeout(30)

GOOD = "0123456789abcdef0123456789abcdef"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


# -- where the secret comes from ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "env", "config", "expected"),
    [
        (
            "f.secret",
            {"MLXPP_CLUSTER_SECRET_FILE": "e", "MLXPP_CLUSTER_SECRET": "v"},
            "c",
            SecretSource("--cluster-secret-file", Path("f.secret")),
        ),
        (
            None,
            {"MLXPP_CLUSTER_SECRET_FILE": "e", "MLXPP_CLUSTER_SECRET": "v"},
            "c",
            SecretSource("MLXPP_CLUSTER_SECRET_FILE", Path("e")),
        ),
        (None, {"MLXPP_CLUSTER_SECRET": "v"}, "c", SecretSource("MLXPP_CLUSTER_SECRET", value="v")),
        (
            None,
            {},
            "/etc/mlxpp/c.secret",
            SecretSource("[cluster] secret_file", Path("/etc/mlxpp/c.secret")),
        ),
        (None, {"MLXPP_CLUSTER_SECRET_FILE": "", "MLXPP_CLUSTER_SECRET": ""}, None, None),
    ],
    ids=[
        "flag first",
        "then the file variable",
        "then the value variable",
        "then the TOML",
        "empty variables are unset",
    ],
)
def test_the_first_configured_source_wins_in_the_documented_order(
    flag: str | None, env: dict[str, str], config: str | None, expected: SecretSource | None
) -> None:
    got = resolve_secret_source(flag_path=flag, environ=env, config_secret_file=config)
    assert got == expected
    if got is not None:
        assert got.value == expected.value  # type: ignore[union-attr]


def test_a_relative_toml_path_means_next_to_the_toml() -> None:
    got = resolve_secret_source(
        flag_path=None, environ={}, config_secret_file="c.secret", config_dir=Path("/etc/mlxpp")
    )
    assert got is not None and got.path == Path("/etc/mlxpp/c.secret")


def _assert_lists_the_four_sources_in_order(message: str) -> None:
    listing = message[message.index("in this order") :]
    positions = [listing.index(f"{i}. {source}") for i, source in enumerate(SECRET_SOURCES, 1)]
    assert positions == sorted(positions), message
    assert "mlxppctl secret new" in message


def test_a_missing_secret_is_a_start_up_error_listing_the_four_sources_in_order() -> None:
    with pytest.raises(ConfigurationError) as error:
        load_cluster_secret(environ={})
    assert error.value.exit_code == 2
    _assert_lists_the_four_sources_in_order(str(error.value))


@pytest.mark.parametrize("where", ["flag", "file variable", "value variable", "toml"])
def test_a_short_secret_is_a_start_up_error_naming_where_it_came_from_and_the_fix(
    tmp_path: Path, where: str
) -> None:
    short = "tooShort15bytes"  # 15 base64 characters: 90 bits at most
    path = _write(tmp_path / "short.secret", short + "\n")
    kwargs: dict[str, object] = {"environ": {}}
    if where == "flag":
        kwargs["flag_path"] = path
    elif where == "file variable":
        kwargs["environ"] = {"MLXPP_CLUSTER_SECRET_FILE": str(path)}
    elif where == "value variable":
        kwargs["environ"] = {"MLXPP_CLUSTER_SECRET": short}
    else:
        kwargs["config_secret_file"] = str(path)
    with pytest.raises(ConfigurationError, match="15 characters, at most 90 bits") as error:
        load_cluster_secret(**kwargs)  # type: ignore[arg-type]
    message = str(error.value)
    origin = {"flag": "--cluster-secret-file", "file variable": "MLXPP_CLUSTER_SECRET_FILE"}
    origin |= {"value variable": "MLXPP_CLUSTER_SECRET", "toml": "[cluster] secret_file"}
    assert f"the cluster secret from {origin[where]}" in message
    assert "too weak" in message and "`mlxppctl secret new PATH`" in message
    assert error.value.exit_code == 2
    assert short not in message  # not even a wrong secret is shown


def test_an_unreadable_secret_file_names_the_file_and_where_it_was_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.secret"
    with pytest.raises(ConfigurationError) as error:
        load_cluster_secret(environ={"MLXPP_CLUSTER_SECRET_FILE": str(missing)})
    assert str(missing) in str(error.value) and "MLXPP_CLUSTER_SECRET_FILE" in str(error.value)


def test_the_secret_is_the_file_content_without_surrounding_whitespace(tmp_path: Path) -> None:
    path = _write(tmp_path / "s", f"  {GOOD}\n")
    secret = load_cluster_secret(flag_path=path, environ={})
    assert secret.key_bytes() == GOOD.encode()
    assert "--cluster-secret-file" in secret.origin
    assert GOOD not in repr(secret) and GOOD not in str(secret)


def test_a_secret_file_others_can_read_is_refused_unless_allowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(tmp_path / "s", GOOD)
    path.chmod(0o644)
    with pytest.raises(ConfigurationError, match=f"run `chmod 600 {path}`") as error:
        load_cluster_secret(flag_path=path, environ={})
    assert "--allow-loose-secret-file" in str(error.value) and GOOD not in str(error.value)
    with caplog.at_level(logging.WARNING):
        secret = load_cluster_secret(flag_path=path, environ={}, allow_loose=True)
        again = load_cluster_secret(flag_path=path, environ={"MLXPP_ALLOW_LOOSE_SECRET_FILE": "1"})
    assert secret.key_bytes() == again.key_bytes() == GOOD.encode()
    assert "chmod 600" in caplog.text and GOOD not in caplog.text


def test_a_cluster_secret_refuses_to_be_short_or_pickled() -> None:
    with pytest.raises(ValueError):
        ClusterSecret(b"short", "test")
    import pickle

    with pytest.raises(TypeError):
        pickle.dumps(ClusterSecret(GOOD.encode(), "test"))


# -- mlxppctl secret new -----------------------------------------------------------------------


def test_a_new_secret_is_32_random_bytes_in_hex_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "cluster.secret"
    write_new_secret(path)
    text = path.read_text()
    assert len(text) == 65 and text.endswith("\n") and bytes.fromhex(text.strip())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_cluster_secret(flag_path=path, environ={}).key_bytes() == text.strip().encode()
    other = tmp_path / "other.secret"
    write_new_secret(other)
    assert other.read_text() != text


def test_an_existing_secret_is_replaced_only_with_force(tmp_path: Path) -> None:
    path = _write(tmp_path / "cluster.secret", GOOD)
    with pytest.raises(ConfigurationError, match="--force"):
        write_new_secret(path)
    assert path.read_text() == GOOD
    path.chmod(0o644)
    write_new_secret(path, force=True)
    assert path.read_text() != GOOD
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.secret"]  # no temporary left


def test_mlxppctl_secret_new_writes_the_file_and_never_prints_the_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cluster.secret"
    assert mlxppctl(["secret", "new", str(path)]) == 0
    out = capsys.readouterr()
    secret = path.read_text().strip()
    assert secret not in out.out + out.err
    assert str(path) in out.err
    assert mlxppctl(["secret", "new", str(path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert mlxppctl(["secret", "new", "--force", str(path)]) == 0
    assert path.read_text().strip() != secret
    assert os.stat(path).st_mode & 0o077 == 0
