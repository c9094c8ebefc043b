"""``mlxppctl discover``'s bad input is one sentence naming the flag or file and the fix (the
browsing itself runs between network namespaces: tests/runtime/test_dnssd_discovery.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxppd.cli.mlxppctl_main import main
from mlxppd.wire.secret import write_new_secret


@pytest.mark.parametrize("timeout", ["0", "-1", "61"])
def test_a_timeout_out_of_range_names_the_flag(
    timeout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "s"
    write_new_secret(secret)
    argv = ["discover", "--timeout", timeout, "--cluster-name", "lab",
            "--cluster-secret-file", str(secret)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--timeout" in err and "0 to 60" in err


def test_without_a_cluster_name_it_says_where_it_looked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["discover", "--config-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--cluster-name" in err and str(tmp_path / "cluster.toml") in err


def test_without_a_secret_it_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLXPP_CLUSTER_SECRET_FILE", raising=False)
    monkeypatch.delenv("MLXPP_CLUSTER_SECRET", raising=False)
    argv = ["discover", "--cluster-name", "lab", "--config-dir", str(tmp_path)]
    assert main(argv) == 2
    assert "--cluster-secret-file" in capsys.readouterr().err
