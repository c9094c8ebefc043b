"""Operator keys: ``mlxppctl operator-key new|public``, and the admin API of a real local cluster
(``mlxppd serve --pp-size 2 --operator NAME=KEY``) that lists one under ``[operators]``: the
listed operator's ``mlxppctl drain`` works; a stage host's node key, an unlisted key and the
cluster secret's HMAC are refused. Without ``[operators]`` (legacy mode) the secret still signs;
a cluster whose every node is on loopback has no other host holding it, so no warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from mlxppd.wire.admin_auth import admin_key, sign_request
from mlxppd.wire.operator_key import OperatorKey, load_operator_key
from mlxppd.wire.secret import write_new_secret
from tests.support.clusters import RunningCluster, start_cluster
from tests.support.mlxppctl import clean_env, mlxppctl, one_line_error

LINE = re.compile(r'(?P<name>[A-Za-z0-9._-]+) = "(?P<key>[A-Za-z0-9+/]{43}=)"')
LEGACY_WARNING = "the cluster TOML lists no [operators]"


def new_key(path: Path, name: str, env: dict[str, str]) -> str:
    """``mlxppctl operator-key new PATH --name NAME``: the [operators] line it printed."""
    proc = mlxppctl("operator-key", "new", str(path), "--name", name, env=env)
    assert proc.returncode == 0, proc.stderr
    assert LINE.fullmatch(proc.stdout.strip()), proc.stdout
    return proc.stdout.strip()


# --- the key file ---


def test_new_writes_a_private_key_file_and_prints_its_operators_line(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    path = tmp_path / "alice.key"
    line = new_key(path, "alice", env)
    assert os.stat(path).st_mode & 0o777 == 0o600
    text = path.read_text()
    assert re.fullmatch(r"alice:[A-Za-z0-9+/]{43}=\n", text)
    assert text.split(":")[1].strip() not in line  # the private half is never printed
    key = load_operator_key(path)
    assert (key.name, line) == ("alice", key.operators_line)
    shown = mlxppctl("operator-key", "public", str(path), env=env)
    assert (shown.returncode, shown.stdout.strip()) == (0, line)


def test_new_does_not_replace_a_key_without_force(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    path = tmp_path / "alice.key"
    first = new_key(path, "alice", env)
    line = one_line_error(mlxppctl("operator-key", "new", str(path), "--name", "x", env=env), 2)
    assert "already exists" in line and "--force" in line
    proc = mlxppctl("operator-key", "new", str(path), "--name", "alice", "--force", env=env)
    assert proc.returncode == 0 and proc.stdout.strip() != first


def test_a_bad_name_or_a_loose_file_is_one_error(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    bad = mlxppctl("operator-key", "new", str(tmp_path / "k"), "--name", "al ice", env=env)
    assert "--name" in one_line_error(bad, 2)
    path = tmp_path / "alice.key"
    new_key(path, "alice", env)
    path.chmod(0o644)
    line = one_line_error(mlxppctl("operator-key", "public", str(path), env=env), 2)
    assert f"chmod 600 {path}" in line


# --- a live cluster that lists an operator ---


@dataclass
class Live:
    cluster: RunningCluster
    secret: Path
    alice: Path
    env: dict[str, str]

    def ctl(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        proc = mlxppctl(*args, "--url", self.cluster.url, env=env or self.env)
        return proc.returncode, proc.stdout, proc.stderr

    def admission(self) -> str:
        code, out, err = self.ctl("status", "--json", "--operator-key", str(self.alice))
        assert code == 0, err
        return str(re.search(r'"admission": "(\w+)"', out)[1])  # type: ignore[index]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("operators")
    env = clean_env(root)
    secret = root / "cluster.secret"
    write_new_secret(secret)
    alice = root / "alice.key"
    line = new_key(alice, "alice", env)
    serve_env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    flags = (
        "--pp-size",
        "2",
        "--metrics",
        "--cluster-secret-file",
        str(secret),
        "--operator",
        line,
    )
    cluster = start_cluster(root, serve_env, *flags)
    try:
        yield Live(cluster, secret, alice, {**env, "MLXPP_MODEL_CACHE": str(model_cache)})
    finally:
        assert cluster.stop() == 0, cluster.log()[-3000:]


@pytest.mark.slow
def test_the_listed_operator_drains_and_resumes(live: Live) -> None:
    code, out, err = live.ctl("drain", "--operator-key", str(live.alice))
    assert (code, out.startswith("admission draining")) == (0, True), err
    assert live.admission() == "draining"
    # The variable does what the flag does.
    code, out, err = live.ctl(
        "resume", env={**live.env, "MLXPP_OPERATOR_KEY_FILE": str(live.alice)}
    )
    assert (code, out.startswith("admission open")) == (0, True), err
    assert live.admission() == "open"
    log = live.cluster.log()
    assert "admin request POST /admin/v1/drain signed by operator alice" in log  # the record
    assert LEGACY_WARNING not in log


@pytest.mark.slow
def test_the_cluster_secret_signs_nothing_once_operators_are_listed(live: Live) -> None:
    code, _, err = live.ctl("drain", "--cluster-secret-file", str(live.secret))
    assert code == 3 and len(err.strip().splitlines()) == 1, err
    assert "takes only operator signatures" in err and "--operator-key PATH" in err
    assert live.admission() == "open"
    # What any client sees: the challenge asks for operator signatures, and an HMAC made with
    # the secret a stage host holds is a 401 saying to sign with an operator key.
    page = httpx.get(f"{live.cluster.url}/admin/v1/challenge").json()
    assert page == {"scheme": "MLXPP-ED25519", "cluster": "mlxpp-local"}
    host = live.cluster.url.split("//", 1)[1]
    key = admin_key(live.secret.read_bytes().strip())
    header = sign_request(
        key, "POST", "/admin/v1/drain", b"", now=time.time(), cluster="mlxpp-local", host=host
    )
    answer = httpx.post(f"{live.cluster.url}/admin/v1/drain", headers={"Authorization": header})
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "operator_key_required"
    assert "mlxppctl --operator-key PATH" in answer.json()["error"]["message"]
    assert answer.headers["WWW-Authenticate"] == 'MLXPP-ED25519 cluster="mlxpp-local"'
    assert live.admission() == "open"


@pytest.mark.slow
def test_a_stage_hosts_node_key_is_refused(live: Live, tmp_path: Path) -> None:
    """A stage host holds its node key and the cluster secret: neither signs a drain."""
    # The key file stage 0 was started with, as its host holds it.
    argv = Path(f"/proc/{live.cluster.stage_pids[0]}/cmdline").read_bytes().split(b"\0")
    node_key = argv[argv.index(b"--node-key-file") + 1].decode()
    raw = Path(node_key).read_text().strip()
    # As a key file of its own, it is not an operator key at all ...
    code, _, err = live.ctl("drain", "--operator-key", node_key)
    assert code == 2 and "does not hold an operator key" in err, err
    # ... and its bytes made into an Ed25519 key under a listed name are refused alike.
    forged = tmp_path / "forged.key"
    forged.write_text(f"alice:{raw}\n")
    forged.chmod(0o600)
    code, _, err = live.ctl("drain", "--operator-key", str(forged))
    assert code == 3 and "bad_signature" in err and "[operators]" in err, err
    assert live.admission() == "open"


@pytest.mark.slow
def test_an_unlisted_operator_key_is_refused(live: Live, tmp_path: Path) -> None:
    mallory = tmp_path / "mallory.key"
    new_key(mallory, "mallory", live.env)
    code, _, err = live.ctl("drain", "--operator-key", str(mallory))
    assert code == 3 and len(err.strip().splitlines()) == 1, err
    assert "refused the signature (bad_signature) of operator 'mallory'" in err
    assert load_operator_key(mallory).operators_line in err  # the line that would let it in
    assert live.admission() == "open"


@pytest.mark.slow
def test_refusals_are_counted_by_reason(live: Live) -> None:
    live.ctl("status", "--cluster-secret-file", str(live.secret))
    metrics = httpx.get(f"{live.cluster.url}/metrics").text
    counted = re.search(
        r'mlxpp_admin_auth_failures_total\{reason="operator_key_required"\} (\S+)', metrics
    )
    assert counted is not None and float(counted[1]) >= 1, metrics[-2000:]


# --- legacy mode ---


@pytest.mark.slow
def test_without_operators_the_secret_signs_a_one_host_cluster_without_a_warning(
    tmp_path: Path, model_cache: Path
) -> None:
    env = clean_env(tmp_path)
    secret = tmp_path / "cluster.secret"
    write_new_secret(secret)
    serve_env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    cluster = start_cluster(
        tmp_path, serve_env, "--pp-size", "2", "--cluster-secret-file", str(secret)
    )
    try:
        proc = mlxppctl(
            "drain", "--url", cluster.url, "--cluster-secret-file", str(secret), env=env
        )
        assert proc.returncode == 0 and proc.stdout.startswith("admission draining"), proc.stderr
        # An operator key means nothing to a cluster that lists none.
        key = tmp_path / "alice.key"
        new_key(key, "alice", env)
        refused = mlxppctl("resume", "--url", cluster.url, "--operator-key", str(key), env=env)
        assert "bad_signature" in one_line_error(refused, 3)
        # Every node is on loopback: no other host holds the secret, so there is nothing to
        # warn of (agents on real hosts warn: tests/runtime/agent/test_operator_reload.py).
        assert LEGACY_WARNING not in cluster.log()
    finally:
        assert cluster.stop() == 0, cluster.log()[-3000:]


def test_an_operator_key_is_never_shown(tmp_path: Path) -> None:
    key = OperatorKey.generate("alice")
    private = key.file_text().split(":")[1].strip()
    assert private not in repr(key) and private not in str(key)
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(key)


@pytest.mark.parametrize("value", ["alice", "alice=notakey", "al ice=" + "A" * 43 + "="])
def test_a_bad_operator_flag_is_one_error_before_anything_starts(
    value: str, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--pp-size", "2", "--operator",
         value], capture_output=True, text=True, env=clean_env(tmp_path), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "--operator" in line and "NAME=PUBLIC_KEY" in line


def test_with_neither_an_operator_key_nor_a_secret_the_error_names_both(tmp_path: Path) -> None:
    proc = mlxppctl("drain", "--url", "http://127.0.0.1:9", env=clean_env(tmp_path))
    line = one_line_error(proc, 2)
    assert "no operator key and no cluster secret" in line
    assert "--operator-key PATH" in line and "--cluster-secret-file PATH" in line
