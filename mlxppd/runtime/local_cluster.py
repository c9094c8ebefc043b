"""A local cluster: N real stage processes on loopback plus the coordinator in this process.

Stages start in ascending order, each waited for until its transport port listens, then the
coordinator. The secret is a fresh one in a private temporary directory, or the
``--cluster-secret-file`` given (so ``mlxppctl --cluster-secret-file`` signs for it). Any
failure stops everything already started; Ctrl-C stops it all. Stage processes
live in their own session (a terminal's Ctrl-C reaches only this supervisor, which stops them in
order) and ask the kernel to end them if the supervisor dies, so none is ever left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlxppd.core.config.cluster import ClusterConfig, parse_cluster_config
from mlxppd.core.config.render import render_cluster_toml
from mlxppd.core.errors import TemporaryError
from mlxppd.core.layer_ranges import LayerRange, format_pp_layers
from mlxppd.runtime.serve import NodeOptions
from mlxppd.wire.secret import load_cluster_secret

log = logging.getLogger("mlxppd.local")

_PR_SET_PDEATHSIG = 1
STAGE_START_TIMEOUT_S = 300.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def local_cluster_toml(ranges: tuple[LayerRange, ...], ports: list[int], name: str) -> str:
    """The cluster TOML of a loopback cluster: a coordinator and one node per stage."""
    lines = [
        "[cluster]",
        f'name = "{name}"',
        f"pipeline_parallel_size = {len(ranges)}",
        f"layers = [{', '.join(repr(r) for r in format_pp_layers(ranges).split(','))}]",
        "",
        "[[nodes]]",
        'id = "coordinator"',
        f'address = "127.0.0.1:{free_port()}"',
        'role = "hybrid"',
    ]
    for i, port in enumerate(ports):
        lines += ["", "[[nodes]]", f'id = "stage-{i}"', f'address = "127.0.0.1:{port}"']
        lines += ['role = "pipeline_stage"', f"stage = {i}"]
    # Round-trip through the validated model so the file is exactly what a node will load.
    config: ClusterConfig = parse_cluster_config("\n".join(lines) + "\n", "local cluster")
    return render_cluster_toml(config)


def _die_with_parent() -> None:
    # Linux: the kernel sends SIGTERM to the stage if the supervisor dies for any reason.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class LocalCluster:
    model: str | None
    ranges: tuple[LayerRange, ...]
    kv_budget_bytes: int | None = None
    max_batch_size: int | None = None
    cpu_weights: str | None = None
    log_level: str = "INFO"
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mlxpp-local-")))
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    given_secret_file: str | None = None
    """--cluster-secret-file: the stages and the coordinator use it; None: a fresh secret"""

    def __post_init__(self) -> None:
        if self.given_secret_file is not None:
            # Checked here, so a bad file is one error, not a stage that failed to start.
            self.secret_file = Path(self.given_secret_file).expanduser().absolute()
            try:
                load_cluster_secret(flag_path=self.secret_file)
            except BaseException:
                shutil.rmtree(self.workdir, ignore_errors=True)
                raise
        else:
            self.secret_file = self.workdir / "cluster.secret"
            fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
        ports = [free_port() for _ in self.ranges]
        self.cluster_file = self.workdir / "cluster.toml"
        self.cluster_file.write_text(local_cluster_toml(self.ranges, ports, "mlxpp-local"))

    def _stage_command(self, index: int, ready: Path) -> list[str]:
        cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve"]
        cmd += ["--distributed-config", str(self.cluster_file), "--node-id", f"stage-{index}"]
        cmd += ["--cluster-secret-file", str(self.secret_file), "--ready-file", str(ready)]
        if self.model:
            cmd += ["--model", self.model]
        if self.max_batch_size is not None:
            cmd += ["--max-batch-size", str(self.max_batch_size)]
        if self.kv_budget_bytes is not None:
            cmd += ["--kv-budget-bytes", str(self.kv_budget_bytes)]
        if self.cpu_weights is not None:
            cmd += ["--cpu-weights", self.cpu_weights]
        return [*cmd, "--log-level", self.log_level]

    def start_stages(self) -> None:
        """Start every stage in ascending order, each listening before the next starts."""
        for i in range(len(self.ranges)):
            ready = self.workdir / f"stage-{i}.ready"
            proc = subprocess.Popen(
                self._stage_command(i, ready),
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
            )
            self.procs.append(proc)
            print(f"starting stage {i}/{len(self.ranges)} (pid {proc.pid})...", file=sys.stderr)
            deadline = time.monotonic() + STAGE_START_TIMEOUT_S
            while not ready.exists():
                if proc.poll() is not None:
                    raise TemporaryError(
                        f"stage {i} exited with status {proc.returncode} before it listened; "
                        "see its error above"
                    )
                if time.monotonic() > deadline:
                    raise TemporaryError(
                        f"stage {i} did not listen within {STAGE_START_TIMEOUT_S}s"
                    )
                time.sleep(0.05)
            print(f"stage {i} listening on {ready.read_text().strip()}", file=sys.stderr)

    def stop(self) -> None:
        """Stop every stage, last first; SIGKILL what does not exit in 10 s."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in reversed(self.procs):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                proc.wait(remaining)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def node_options(self, template: NodeOptions) -> NodeOptions:
        return replace(
            template,
            cluster_file=self.cluster_file,
            node_id="coordinator",
            secret_file=str(self.secret_file),
        )
