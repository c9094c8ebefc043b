"""``mlxppctl status|drain|resume``: the real CLI, as a subprocess, against a real admin server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from mlxppd.runtime.local_cluster import free_port
from tests.support.admin_server import SECRET, AdminServer, ScriptedCluster, status_document
from tests.support.http import LoopThread
from tests.support.mlxppctl import MLXPPCTL, clean_env, mlxppctl, one_line_error, write_secret
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT


@pytest.fixture()
def server() -> Iterator[AdminServer]:
    with AdminServer(ScriptedCluster()) as live:
        yield live


@pytest.fixture()
def secret_file(tmp_path: Path) -> Path:
    return write_secret(tmp_path / "cluster.secret", SECRET)


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path)


# --- status ---


def test_status_prints_the_badge_the_coordinator_and_a_card_per_stage(
    server: AdminServer, secret_file: Path, env: dict[str, str]
) -> None:
    proc = mlxppctl(
        "status", "--url", server.url, "--cluster-secret-file", str(secret_file), env=env
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"cluster mlxpp-cluster: HEALTHY (—|-) all 2 stages connected", lines[0])
    coordinator = lines[1]
    for part in (
        "coordinator coordinator",
        "127.0.0.1:8080",
        "admission open",
        "3 in flight",
        "0 waiting",
        "config generation gen-7",
        "last reload ok",
    ):
        assert part in coordinator
    text = proc.stdout
    assert "stage 0  stage-0  127.0.0.1:19001" in text
    assert "stage 1  stage-1  127.0.0.1:19002" in text
    assert re.search(r"layers\s+15-29", text)
    assert re.search(r"process\s+alive", text)
    assert re.search(r"transport\s+connected", text)
    assert re.search(r"KV cache\s+64\.0 / 512\.0 MiB \(12%\)", text)
    assert re.search(r"elastic state\s+idle", text)
    assert re.search(r"config generation\s+gen-7", text)
    assert re.search(r"last reload error\s+none", text)
    assert re.search(r"weights\s+float32", text)
    assert re.search(r"BLAS\s+OpenBLAS 0\.3\.21 \(libopenblas\.so\.0, Haswell kernels", text)
    assert SECRET.decode() not in text + proc.stderr


def test_status_json_is_the_document_with_health(
    server: AdminServer, secret_file: Path, env: dict[str, str]
) -> None:
    proc = mlxppctl(
        "status", "--json", "--url", server.url, "--cluster-secret-file", str(secret_file), env=env
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert list(doc) == ["cluster", "coordinator", "stages", "standbys", "health", "detail"]
    assert doc["health"] == "healthy"
    assert len(doc["stages"]) == 2


def test_an_unhealthy_cluster_exits_1_and_shows_the_broken_stage(
    server: AdminServer, secret_file: Path, env: dict[str, str]
) -> None:
    server.controller.stages[1].update(
        process_alive=False,
        transport_connected=False,
        in_flight=None,
        kv_used_bytes=None,
        kv_budget_bytes=None,
        elastic_state=None,
        config_generation=None,
    )
    proc = mlxppctl(
        "status", "--url", server.url, "--cluster-secret-file", str(secret_file), env=env
    )
    assert proc.returncode == 1, proc.stderr
    assert "UNHEALTHY" in proc.stdout.splitlines()[0]
    assert "stage 1 (stage-1) is not running" in proc.stdout
    assert re.search(r"process\s+NOT RUNNING", proc.stdout)
    assert re.search(r"KV cache\s+unknown", proc.stdout)


def test_a_degraded_cluster_exits_0(
    server: AdminServer, secret_file: Path, env: dict[str, str]
) -> None:
    server.controller.admission = "draining"
    proc = mlxppctl(
        "status", "--url", server.url, "--cluster-secret-file", str(secret_file), env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "DEGRADED" in proc.stdout and "admission is draining" in proc.stdout


# --- drain and resume ---


def test_drain_and_resume_change_admission(
    server: AdminServer, secret_file: Path, env: dict[str, str]
) -> None:
    target = ("--url", server.url, "--cluster-secret-file", str(secret_file))
    proc = mlxppctl("drain", *target, env=env)
    assert (proc.returncode, proc.stdout) == (0, "admission draining: 3 requests in flight\n")
    assert server.controller.admission == "draining"
    proc = mlxppctl("resume", *target, env=env)
    assert (proc.returncode, proc.stdout) == (0, "admission open\n")
    assert server.controller.admission == "open"


# --- failures ---


def test_a_wrong_secret_exits_3_saying_to_check_the_secret(
    server: AdminServer, tmp_path: Path, env: dict[str, str]
) -> None:
    wrong = write_secret(tmp_path / "wrong.secret", b"a0b1c2d3e4f5061728394a5b6c7d8e9f")
    proc = mlxppctl("drain", "--url", server.url, "--cluster-secret-file", str(wrong), env=env)
    line = one_line_error(proc, 3)
    assert "refused the signature" in line
    assert "cluster secret" in line and str(wrong) in line
    assert server.controller.admission == "open"
    assert server.failures == ["bad_mac"]
    assert "serves cluster" not in line  # the same cluster name: the secret is what differs


def test_an_unreachable_coordinator_exits_3_saying_to_check_the_url(
    secret_file: Path, env: dict[str, str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = mlxppctl(
        "status", "--url", url, "--cluster-secret-file", str(secret_file), "--timeout", "5", env=env
    )
    line = one_line_error(proc, 3)
    assert f"cannot reach the coordinator at {url}" in line
    assert "check --url" in line


@pytest.mark.parametrize("url", ["ftp://10.0.0.1:8080", "http://10.0.0.1:8080/v1", "10.0.0.1"])
def test_a_bad_url_exits_2(url: str, secret_file: Path, env: dict[str, str]) -> None:
    proc = mlxppctl("status", "--url", url, "--cluster-secret-file", str(secret_file), env=env)
    assert "--url" in one_line_error(proc, 2)


def test_no_secret_anywhere_exits_2_listing_where_to_put_one(env: dict[str, str]) -> None:
    proc = mlxppctl("status", "--url", "http://127.0.0.1:9", env=env)
    assert "no cluster secret" in one_line_error(proc, 2)


def test_the_secret_may_come_from_the_environment(server: AdminServer, env: dict[str, str]) -> None:
    env["MLXPP_CLUSTER_SECRET"] = SECRET.decode()
    proc = mlxppctl("status", "--url", server.url, env=env)
    assert proc.returncode == 0, proc.stderr


# --- the config directory ---


def config_dir(tmp_path: Path, port: int, cluster_secret: Path, host_toml: str = "") -> Path:
    """A config dir as on a host: the example cluster.toml (secret_file pointed at a tmp
    secret) and an mlxppd.toml listening on all addresses."""
    directory = tmp_path / "etc-mlxpp"
    directory.mkdir()
    example = (REPO / "etc/mlxpp/cluster.toml").read_text()
    assert 'secret_file = "/etc/mlxpp/cluster.secret"' in example
    (directory / "cluster.toml").write_text(
        example.replace("/etc/mlxpp/cluster.secret", str(cluster_secret))
    )
    (directory / "mlxppd.toml").write_text(
        f'http_host = "0.0.0.0"\nhttp_port = {port}\n' + host_toml
    )
    return directory


def test_the_config_dir_gives_the_address_and_the_clusters_secret(
    server: AdminServer, secret_file: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    directory = config_dir(tmp_path, server.port, secret_file)
    proc = mlxppctl("drain", "--config-dir", str(directory), env=env)
    assert proc.returncode == 0, proc.stderr
    assert server.controller.admission == "draining"
    # MLXPP_CONFIG_DIR does the same.
    env["MLXPP_CONFIG_DIR"] = str(directory)
    proc = mlxppctl("resume", env=env)
    assert proc.returncode == 0, proc.stderr
    assert server.controller.admission == "open"


def test_the_hosts_secret_file_overrides_the_clusters(
    server: AdminServer, secret_file: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    stale = write_secret(tmp_path / "old.secret", b"0123456789abcdef0123456789abcdef")
    # A relative secret_file in mlxppd.toml is relative to the config directory.
    shutil.copy(secret_file, tmp_path / "host.secret")
    directory = config_dir(tmp_path, server.port, stale, 'secret_file = "../host.secret"\n')
    proc = mlxppctl("status", "--config-dir", str(directory), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "HEALTHY" in proc.stdout


def test_a_refusal_names_the_config_files_secret(
    server: AdminServer, tmp_path: Path, env: dict[str, str]
) -> None:
    stale = write_secret(tmp_path / "old.secret", b"0123456789abcdef0123456789abcdef")
    directory = config_dir(tmp_path, server.port, stale)
    line = one_line_error(mlxppctl("status", "--config-dir", str(directory), env=env), 3)
    assert "[cluster] secret_file" in line and str(stale) in line


def test_an_unreachable_configured_address_names_the_config_file(
    secret_file: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    directory = config_dir(tmp_path, free_port(), secret_file)
    line = one_line_error(mlxppctl("status", "--config-dir", str(directory), env=env), 3)
    assert f"http_host/http_port in {directory / 'mlxppd.toml'}" in line


def test_help_shows_examples() -> None:
    proc = subprocess.run(
        [*MLXPPCTL, "status", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    assert "examples:" in proc.stdout and "--cluster-secret-file" in proc.stdout
    assert "exit status" in proc.stdout


# --- the cluster name the signature is bound to ---


def test_a_signature_for_another_cluster_name_says_which_cluster_answered(
    server: AdminServer, secret_file: Path, env: dict[str, str]
) -> None:
    target = ("--url", server.url, "--cluster-secret-file", str(secret_file))
    line = one_line_error(mlxppctl("drain", *target, "--cluster-name", "staging", env=env), 3)
    assert "serves cluster 'mlxpp-cluster'" in line
    assert "signed for cluster 'staging' (from --cluster-name)" in line
    assert "--cluster-name mlxpp-cluster" in line
    assert server.controller.admission == "open"
    proc = mlxppctl("drain", *target, "--cluster-name", "mlxpp-cluster", env=env)
    assert proc.returncode == 0, proc.stderr


def test_a_cluster_name_against_the_node_id_rules_exits_2(
    secret_file: Path, env: dict[str, str]
) -> None:
    proc = mlxppctl(
        "status", "--url", "http://127.0.0.1:9", "--cluster-secret-file", str(secret_file),
        "--cluster-name", "my cluster", env=env,
    )  # fmt: skip
    line = one_line_error(proc, 2)
    assert "--cluster-name" in line and "letters, digits" in line


def test_the_config_dirs_cluster_name_is_signed_for(
    server: AdminServer, secret_file: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    directory = config_dir(tmp_path, server.port, secret_file)
    cluster = directory / "cluster.toml"
    cluster.write_text(cluster.read_text().replace('name = "mlxpp-cluster"', 'name = "prod-2"'))
    line = one_line_error(mlxppctl("status", "--config-dir", str(directory), env=env), 3)
    assert f"signed for cluster 'prod-2' (from [cluster] name in {cluster})" in line


# --- secret files ---


def test_a_secret_file_others_can_read_is_refused_unless_allowed(
    server: AdminServer, secret_file: Path, env: dict[str, str]
) -> None:
    secret_file.chmod(0o644)
    target = ("--url", server.url, "--cluster-secret-file", str(secret_file))
    line = one_line_error(mlxppctl("status", *target, env=env), 2)
    assert str(secret_file) in line and f"chmod 600 {secret_file}" in line
    assert "--allow-loose-secret-file" in line
    proc = mlxppctl("status", *target, "--allow-loose-secret-file", env=env)
    assert proc.returncode == 0, proc.stderr
    proc = mlxppctl("status", *target, env={**env, "MLXPP_ALLOW_LOOSE_SECRET_FILE": "1"})
    assert proc.returncode == 0, proc.stderr


# --- redirects are reported, never followed with a signature ---


class Recorder(LoopThread):
    """A tiny aiohttp server on loopback that records each request and answers with
    ``answer(request)``."""

    def __init__(self, answer: Callable[[web.Request], web.StreamResponse]) -> None:
        super().__init__("recorder-loop")
        self.seen: list[tuple[str, str, str | None]] = []

        async def handle(request: web.Request) -> web.StreamResponse:
            self.seen.append(
                (request.method, request.path_qs, request.headers.get("Authorization"))
            )
            return answer(request)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.url = self.serve(app)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.mark.parametrize(
    "named", [False, True], ids=["name from the coordinator", "--cluster-name"]
)
def test_a_redirect_is_an_error_naming_the_location_and_is_never_followed(
    secret_file: Path, env: dict[str, str], named: bool
) -> None:
    with (
        Recorder(lambda _: web.json_response({"cluster": "mlxpp-cluster"})) as elsewhere,
        Recorder(
            lambda r: web.Response(status=307, headers={"Location": elsewhere.url + r.path_qs})
        ) as redirecting,
    ):
        flags = ["--cluster-name", "mlxpp-cluster"] if named else []
        # A GET: urllib itself would follow a 307 for it, Authorization header and all.
        proc = mlxppctl(
            "status", "--url", redirecting.url, "--cluster-secret-file", str(secret_file), *flags,
            env=env,
        )  # fmt: skip
        line = one_line_error(proc, 3)
        expected = "/admin/v1/status" if named else "/admin/v1/challenge"
        assert f"answered HTTP 307 redirecting to {elsewhere.url}{expected}" in line
        assert "never sends a signed request on" in line
        assert elsewhere.seen == []
        [(method, path, auth)] = redirecting.seen
        assert (method, path) == ("GET", expected)
        assert (auth is not None) is named  # the probe for the name carries no signature


def test_status_text_shows_each_partition_warning_on_its_own_line() -> None:
    from mlxppd.cli.ctl_admin import render_status

    warnings = [
        "3 stages over TCP: each extra TCP hop adds latency",
        "model family 'jamba' is outside the best-tested set",
    ]
    document = status_document(0, cluster="c", coordinator={"warnings": warnings})
    lines = render_status(document, dash="-").splitlines()
    assert lines[2:4] == [
        "warning: 3 stages over TCP: each extra TCP hop adds latency",
        "warning: model family 'jamba' is outside the best-tested set",
    ]
    quiet = render_status(status_document(0, coordinator={"warnings": []}), dash="-")
    assert "warning:" not in quiet


def test_an_answer_that_is_not_a_status_document_exits_3_naming_the_field(
    secret_file: Path, env: dict[str, str]
) -> None:
    """Another mlxpp version's coordinator (a key this mlxppctl does not know): one line."""
    with Recorder(lambda _: web.json_response({"cluster": "mlxpp-cluster", "nodes": []})) as odd:
        proc = mlxppctl(
            "status", "--url", odd.url, "--cluster-secret-file", str(secret_file),
            "--cluster-name", "mlxpp-cluster", env=env,
        )  # fmt: skip
    line = one_line_error(proc, 3)
    assert "is not the StatusDocument this mlxppctl reads" in line
    assert "coordinator: Field required" in line and "same mlxpp version" in line
