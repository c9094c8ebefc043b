"""Zero-config bring-up: `serve --pp-auto N` and `serve --pp-peer`, no hand-written TOML.

Dry runs use loopback; the bring-ups put the coordinator and two peers in their own network
namespaces (tests/support/agents.py), with static seeds and with signed beacons.
"""

from __future__ import annotations

import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxppd import __version__
from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.runtime.local_cluster import free_port
from mlxppd.wire.node_key import load_node_key
from tests.support.adapters import adapted_answers, random_adapter
from tests.support.agents import CHAT, VENV_BIN, Hosts, in_host_python, netns_unavailable
from tests.support.node_keys import roster_toml, write_node_keys
from tests.support.references import greedy_answers

pytestmark = pytest.mark.slow

MLXPPD = str(VENV_BIN / "mlxppd")
QUESTION = "What is the capital of France?"
#: tokens of each answer compared with mlx-lm's
TOKENS = 8


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("zc") / "cluster.secret"
    path.write_text("zero-config-secret-0123456789abcdef\n")
    path.chmod(0o600)
    path.chmod(0o600)
    return path


def serve(
    env: dict[str, str], *flags: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MLXPPD, "serve", *flags], capture_output=True, text=True, env=env, timeout=timeout
    )


# -- flag errors and dry runs (loopback) -------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--pp-auto", "2", "--distributed-config", "x.toml"], "drop --distributed-config"),
        (["--pp-auto", "2", "--pp-layers", "0-14,15-29"], "drop --pp-layers"),
        (["--pp-auto", "2", "--pp-peer"], "either the coordinator (--pp-auto) or a peer"),
        (["--pp-auto", "2"], "static discovery needs --cluster-peers"),
        (["--dry-run"], "add --pp-auto N"),
        (["--pp-peer"], "needs --cluster-control-addr HOST:PORT"),
    ],
)
def test_flag_conflicts_explain_which_to_drop(
    cli_env: dict[str, str], secret: Path, flags: list[str], expected: str
) -> None:
    done = serve(cli_env, *flags, "--cluster-secret-file", str(secret))
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr


def dry_run(
    env: dict[str, str], secret: Path, out: Path, *flags: str
) -> subprocess.CompletedProcess[str]:
    return serve(
        env, "--pp-auto", "2", "--dry-run", "--cluster-secret-file", str(secret),
        "--cluster-config-out", str(out), *flags,
    )  # fmt: skip


def test_dry_run_without_peers_plans_with_equal_memory(
    cli_env: dict[str, str], secret: Path, tmp_path: Path
) -> None:
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    out = tmp_path / "cluster.toml"
    # Its own control port: the default (39600) may be a local cluster's in another test.
    tb = (
        "--transport-backend",
        "thunderbolt",
        "--cluster-control-addr",
        f"127.0.0.1:{free_port()}",
    )
    done = dry_run(cli_env, secret, out, "--cluster-peers", f"{b},{a}", "--port", "18099", *tb)
    assert done.returncode == 0, done.stderr
    first, second = sorted([a, b])
    assert f"    - stage-0 @ {first} [pipeline_stage]" in done.stdout
    assert f"    - stage-1 @ {second} [pipeline_stage]" in done.stdout
    assert "did not answer; planned with equal memory" in done.stdout
    assert f"Emitted cluster TOML at: {out.resolve()}" in done.stdout
    assert 'layers = ["0-14", "15-29"]' in out.read_text()
    assert 'transport_backend = "thunderbolt"' in out.read_text()  # --transport-backend
    # The same peers in the other order: the same bytes.
    again = tmp_path / "again.toml"
    flags = ("--cluster-peers", f"{a},{b}", "--port", "18099", *tb)
    assert dry_run(cli_env, secret, again, *flags).returncode == 0
    assert again.read_bytes() == out.read_bytes()


def test_dry_run_with_too_few_peers_fails_with_a_hint(
    cli_env: dict[str, str], secret: Path, tmp_path: Path
) -> None:
    done = dry_run(cli_env, secret, tmp_path / "c.toml", "--cluster-peers", "127.0.0.1:1")
    assert done.returncode != 0
    assert (
        "1 peer" in done.stderr
        and "--pp-auto 2" in done.stderr
        and "--cluster-peers" in done.stderr
    )


def test_dry_run_with_control_equal_to_http_fails_with_a_hint(
    cli_env: dict[str, str], secret: Path, tmp_path: Path
) -> None:
    peers, same = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}", free_port()
    done = dry_run(
        cli_env, secret, tmp_path / "c.toml", "--cluster-peers", peers,
        "--cluster-control-addr", f"127.0.0.1:{same}", "--port", str(same),
    )  # fmt: skip
    assert done.returncode != 0
    assert "--cluster-control-addr" in done.stderr and "--port" in done.stderr


def test_dry_run_with_a_planned_port_in_use_fails_with_a_hint(
    cli_env: dict[str, str], secret: Path, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        peers = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
        done = dry_run(
            cli_env, secret, tmp_path / "c.toml", "--cluster-peers", peers,
            "--cluster-control-addr", f"127.0.0.1:{port}", "--port", str(free_port()),
        )  # fmt: skip
    assert done.returncode != 0
    assert f"127.0.0.1:{port} is already bound" in done.stderr
    assert "change --cluster-control-addr" in done.stderr


# -- bring-up across network namespaces --------------------------------------------------------

_WHY = netns_unavailable()
needs_netns = pytest.mark.skipif(
    _WHY is not None, reason=f"zero-config bring-up tests need network namespaces: {_WHY}"
)


@pytest.fixture(scope="module")
def reference(embedded_model_dir: Path) -> str:
    return greedy_answers(embedded_model_dir, [(QUESTION, TOKENS)])[(QUESTION, TOKENS)]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    made = Hosts.create(3)
    try:
        yield made
    finally:
        made.destroy()


class Procs:
    def __init__(self, root: Path):
        self.root = root
        self.items: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, hosts: Hosts, index: int, name: str, env: dict[str, str], *flags: str) -> Any:
        log = self.root / f"{name}.log"
        with log.open("wb") as f:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", hosts.names[index], MLXPPD, "serve", *flags],
                env=env, stdout=f, stderr=subprocess.STDOUT, cwd=self.root,
            )  # fmt: skip
        self.items.append((name, proc, log))
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for _, proc, _ in self.items:
            if proc.poll() is None:
                proc.terminate()
        for _, proc, _ in self.items:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    running = Procs(tmp_path)
    try:
        yield running
    finally:
        running.stop()


def wait_file(path: Path, proc: subprocess.Popen[bytes], log: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, log
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)
    return path.read_text().strip()


def peer_flags(secret: Path, *more: str) -> list[str]:
    return ["--pp-peer", "--cluster-secret-file", str(secret), *more]


@needs_netns
@pytest.mark.parametrize("discovery", ["static", "mdns"])
def test_bring_up_answers_like_mlx_lm(
    hosts: Hosts, procs: Procs, secret: Path, cli_env: dict[str, str], reference: str,
    discovery: str, embedded_model_dir: Path,
) -> None:  # fmt: skip
    a0, a1, a2 = hosts.addresses
    for i in (1, 2):
        if discovery == "static":
            extra = ["--cluster-control-addr", f"{hosts.addresses[i]}:19001"]
        else:
            # Beacons go to the coordinator's address (a network that may drop broadcast).
            extra = ["--cluster-discovery", "mdns", "--cluster-discovery-target", a0]
        procs.start(hosts, i, f"peer{i}", cli_env, *peer_flags(secret, *extra))
    ready = procs.root / "coordinator.ready"
    found = (
        ["--cluster-peers", f"{a2}:19001,{a1}:19001"]
        if discovery == "static"
        else ["--cluster-discovery", "mdns"]
    )
    if discovery == "static":
        # The dry run asks each live peer what it runs (package and wire protocol versions).
        deadline = time.monotonic() + 300
        while not (_waiting(procs, "peer1") and _waiting(procs, "peer2")):
            assert time.monotonic() < deadline, procs.log("peer1") + procs.log("peer2")
            time.sleep(0.2)
        checked = hosts.run(
            0, MLXPPD, "serve", "--pp-auto", "2", "--dry-run", "--cluster-secret-file",
            str(secret), *found, "--cluster-control-addr", f"{a0}:19000",
            "--cluster-config-out", str(procs.root / "dry.toml"), env=cli_env,
        )  # fmt: skip
        assert checked.returncode == 0, checked.stderr
        for address in (a1, a2):
            assert f"peer {address}:19001 runs mlxpp {__version__}, wire protocol" in checked.stdout
    # The static bring-up also serves an adapter: the peers get it in the TOML they are given.
    adapter = (
        random_adapter(embedded_model_dir, procs.root / "zc-adapter")
        if discovery == "static"
        else None
    )
    extra = ["--adapter", f"zc={adapter}"] if adapter is not None else []
    coordinator = procs.start(
        hosts, 0, "coordinator", cli_env,
        "--pp-auto", "2", "--cluster-secret-file", str(secret), *found,
        "--cluster-control-addr", f"{a0}:19000", "--host", "0.0.0.0", "--port", "8080",
        "--ready-file", str(ready), *extra,
    )  # fmt: skip
    wait_file(ready, coordinator, procs.log("coordinator"))
    answer = in_host_python(hosts, 0, CHAT, f"http://{a0}:8080", QUESTION, str(TOKENS))
    assert answer["status"] == 200, answer
    assert answer["body"]["choices"][0]["message"]["content"] == reference
    if adapter is not None:
        asks = [(QUESTION, TOKENS)]
        adapted = adapted_answers(embedded_model_dir, adapter, asks)[(QUESTION, TOKENS)]
        assert adapted != reference  # not vacuous
        answer = in_host_python(hosts, 0, CHAT, f"http://{a0}:8080", QUESTION, str(TOKENS), "zc")
        assert answer["body"]["choices"][0]["message"]["content"] == adapted, answer
    plan = (procs.root / ".mlxpp" / "cluster.toml").read_text()
    # Each peer holds the very bytes the coordinator planned, under its own node id.
    assert (procs.root / ".mlxpp" / "cluster-stage-0.toml").read_text() == plan
    assert (procs.root / ".mlxpp" / "cluster-stage-1.toml").read_text() == plan
    # It serves with node keys: the roster lists every node's own key, each beside its TOML.
    roster = parse_cluster_config(plan, "plan").node_roster
    assert roster.node_ids() == {"coordinator", "stage-0", "stage-1"}
    for stem, node in [("cluster", "coordinator"), ("cluster-stage-0", "stage-0"),
                       ("cluster-stage-1", "stage-1")]:  # fmt: skip
        key_file = procs.root / ".mlxpp" / f"{stem}.node.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600, key_file
        assert roster.key_of(node) == load_node_key(node, flag_path=key_file).public
    if discovery == "mdns":
        assert "discovered peer" in procs.log("coordinator")


def _waiting(procs: Procs, name: str) -> bool:
    return "waiting for its stage assignment" in procs.log(name)


@needs_netns
def test_a_peer_with_another_model_refuses_and_nothing_starts(
    hosts: Hosts, procs: Procs, secret: Path, cli_env: dict[str, str],
    embedded_model_dir: Path, tmp_path: Path,
) -> None:  # fmt: skip
    other = tmp_path / "other-model"
    shutil.copytree(embedded_model_dir, other)
    weights = next(other.glob("*.safetensors"))
    with weights.open("ab") as f:
        f.write(b"\0" * 8)  # same names, another size: not the same checkpoint
    a0, a1, a2 = hosts.addresses
    good = procs.start(hosts, 1, "peer1", cli_env,
                       *peer_flags(secret, "--cluster-control-addr", f"{a1}:19001"))  # fmt: skip
    bad = procs.start(hosts, 2, "peer2", cli_env, *peer_flags(
        secret, "--cluster-control-addr", f"{a2}:19001", "--model", str(other)))  # fmt: skip
    deadline = time.monotonic() + 120
    while not (_waiting(procs, "peer1") and _waiting(procs, "peer2")):
        assert time.monotonic() < deadline, procs.log("peer1") + procs.log("peer2")
        time.sleep(0.2)
    ready = procs.root / "coordinator.ready"
    done = hosts.run(
        0, MLXPPD, "serve", "--pp-auto", "2", "--cluster-secret-file", str(secret),
        "--cluster-peers", f"{a1}:19001,{a2}:19001", "--cluster-control-addr", f"{a0}:19000",
        "--ready-file", str(ready), timeout=300, env=cli_env, cwd=procs.root,
    )  # fmt: skip
    assert done.returncode != 0
    assert "refused stage 1 (model_mismatch)" in done.stderr
    assert "nothing was started" in done.stderr
    assert not ready.exists()
    time.sleep(1.0)
    # Neither peer started a stage or wrote a TOML; both still wait for an assignment.
    assert good.poll() is None and bad.poll() is None
    assert "serving layers" not in procs.log("peer1") + procs.log("peer2")
    assert not list((procs.root / ".mlxpp").glob("cluster-*.toml"))
    assert "refusing stage 1" in procs.log("peer2")
    assert "aborted the assignment" in procs.log("peer1")


@needs_netns
def test_a_peer_with_the_wrong_secret_is_never_offered_anything(
    hosts: Hosts, procs: Procs, secret: Path, cli_env: dict[str, str], tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("another-secret-entirely-0123456789\n")
    wrong.chmod(0o600)
    wrong.chmod(0o600)
    a0, a1, a2 = hosts.addresses
    procs.start(
        hosts, 1, "peer1", cli_env, *peer_flags(secret, "--cluster-control-addr", f"{a1}:19001")
    )
    procs.start(
        hosts, 2, "peer2", cli_env, *peer_flags(wrong, "--cluster-control-addr", f"{a2}:19001")
    )
    deadline = time.monotonic() + 120
    while not (_waiting(procs, "peer1") and _waiting(procs, "peer2")):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    done = hosts.run(
        0, MLXPPD, "serve", "--pp-auto", "2", "--cluster-secret-file", str(secret),
        "--cluster-peers", f"{a1}:19001,{a2}:19001", "--cluster-control-addr", f"{a0}:19000",
        timeout=300, env=cli_env, cwd=procs.root,
    )  # fmt: skip
    assert done.returncode != 0
    assert f"peer {a2}:19001 refused the handshake" in done.stderr
    time.sleep(1.0)
    assert "accepted stage" not in procs.log("peer1") + procs.log("peer2")
    assert not list((procs.root / ".mlxpp").glob("cluster-*.toml"))


def test_a_peer_given_a_cluster_toml_uses_it_as_is(
    cli_env: dict[str, str], secret: Path, tmp_path: Path
) -> None:
    """`--pp-peer --distributed-config F --node-id ID` skips the wait and serves that stage."""
    port = free_port()
    toml = tmp_path / "cluster.toml"
    toml.write_text(
        "[cluster]\npipeline_parallel_size = 2\n\n"
        f'[[nodes]]\nid = "coordinator"\naddress = "127.0.0.1:{free_port()}"\nrole = "hybrid"\n\n'
        f'[[nodes]]\nid = "stage-0"\naddress = "127.0.0.1:{port}"\nrole = "pipeline_stage"\n'
        "stage = 0\n\n"
        f'[[nodes]]\nid = "stage-1"\naddress = "127.0.0.1:{free_port()}"\n'
        'role = "pipeline_stage"\nstage = 1\n' + roster_toml(["coordinator", "stage-0", "stage-1"])
    )
    write_node_keys(tmp_path, ["stage-0"])["stage-0"].rename(tmp_path / "node.key")  # beside it
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [MLXPPD, "serve", "--pp-peer", "--distributed-config", str(toml), "--node-id", "stage-0",
         "--cluster-secret-file", str(secret), "--ready-file", str(ready)],
        env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert wait_file(ready, proc, "", timeout=240) == f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(60)
    assert proc.stderr is not None
    assert b"waiting for its stage assignment" not in proc.stderr.read()
