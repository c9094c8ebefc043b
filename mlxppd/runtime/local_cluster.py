"""A local cluster: N real stage processes on loopback plus the coordinator in this process.

Stages start in ascending order, each waited for until its transport port listens, then the
coordinator. The secret is a fresh one in a private temporary directory, or the
``--cluster-secret-file`` given (so ``mlxppctl --cluster-secret-file`` signs for it). Any
failure stops everything already started; Ctrl-C stops it all. Stage processes
live in their own session (a terminal's Ctrl-C reaches only this supervisor, which stops them in
order) and ask the kernel to end them if the supervisor dies, so none is ever left behind.

While the coordinator runs, ``supervision()`` restarts a stage process that exits (a crash, an
OOM kill) on the same port with the same command, paced by ``mlxppd/core/restart_policy.py``.
It runs on the coordinator's event loop, in the main thread: ``PR_SET_PDEATHSIG`` fires when the
*thread* that started a child ends, so a helper thread would take its restarted stages with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
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
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlxppd.core.adapters import parse_adapter_flag
from mlxppd.core.config.cluster import ClusterConfig, parse_cluster_config
from mlxppd.core.config.ports import (
    DEFAULT_TRANSPORT_PORT_RANGE,
    TRANSPORT_PORT_RANGE_SETTING,
    PortRange,
    choose_ports,
    parse_port_range,
)
from mlxppd.core.config.render import render_cluster_toml
from mlxppd.core.errors import TemporaryError
from mlxppd.core.layer_ranges import LayerRange, format_pp_layers
from mlxppd.core.restart_policy import RestartPolicy
from mlxppd.engine.stage_threads import SOLO_ENV
from mlxppd.runtime.observability.timeline import StartTimeline
from mlxppd.runtime.serve import NodeOptions
from mlxppd.wire.node_key import write_new_node_key
from mlxppd.wire.secret import load_cluster_secret
from mlxppd.wire.tasks import spawn, stop_tasks

log = logging.getLogger("mlxppd.local")

_PR_SET_PDEATHSIG = 1
STAGE_START_TIMEOUT_S = 300.0
SUPERVISE_POLL_S = 0.2


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a stage could listen on ``host:port`` now. SO_REUSEADDR, as the stage's
    listener has: a port left in TIME_WAIT by an earlier cluster is free, one that something
    listens on is not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports_in(
    port_range: PortRange, count: int, *, setting: str = TRANSPORT_PORT_RANGE_SETTING
) -> tuple[int, ...]:
    """The first ``count`` ports of ``port_range`` free on loopback, in order;
    ConfigurationError naming ``setting`` when the range cannot give them."""
    return choose_ports(port_range, count, port_is_free, setting=setting)


def local_cluster_toml(
    ranges: tuple[LayerRange, ...],
    ports: list[int],
    name: str,
    *,
    coordinator_port: int | None = None,
    transport_backend: str = "tcp",
    port_range: PortRange | None = None,
    tp: int = 1,
    adapters: tuple[str, ...] = (),
    roster: Mapping[str, str] | None = None,
    operators: Mapping[str, str] | None = None,
) -> str:
    """The cluster TOML of a loopback cluster: a coordinator and one node per stage, or per
    (stage, rank) when ``tp`` > 1 (``ports``: stage-major, then rank; each rank's ring on a
    free port of its own)."""
    lines = [
        "[cluster]",
        f'name = "{name}"',
        f"pipeline_parallel_size = {len(ranges)}",
        f"tensor_parallel_size = {tp}",
        f'transport_backend = "{transport_backend}"',
        f"layers = [{', '.join(repr(r) for r in format_pp_layers(ranges).split(','))}]",
    ]
    if port_range is not None:
        lines.append(f'transport_port_range = "{port_range}"')
    named: list[str] = []
    for flag in adapters:  # --adapter DIR (fused) or NAME=DIR (per request), as absolute paths
        adapter, path = parse_adapter_flag(flag)
        where = json.dumps(str(Path(path).expanduser().absolute()))
        if adapter is None:
            lines.append(f"adapter = {where}")
        else:
            named += ["", "[[adapters]]", f"name = {json.dumps(adapter)}", f"path = {where}"]
    lines += [
        "",
        "[[nodes]]",
        'id = "coordinator"',
        f'address = "127.0.0.1:{coordinator_port or free_port()}"',
        'role = "hybrid"',
    ]
    for n, port in enumerate(ports):
        i, rank = divmod(n, tp)
        lines += ["", "[[nodes]]", f'id = "{stage_node_id(i, rank)}"']
        lines += [f'address = "127.0.0.1:{port}"']
        if tp == 1:
            lines += ['role = "pipeline_stage"', f"stage = {i}"]
        else:
            lines += ['role = "pipeline_tensor_parallel"', f"stage = {i}", f"rank = {rank}"]
            lines += [f'tp_address = "127.0.0.1:{free_port()}"']
    lines += named
    if roster:
        lines += ["", "[roster]"]
        lines += [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in roster.items()]
    if operators:  # who may sign admin requests (docs/admin-api.md)
        lines += ["", "[operators]"]
        lines += [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in operators.items()]
    # Round-trip through the validated model so the file is exactly what a node will load.
    config: ClusterConfig = parse_cluster_config("\n".join(lines) + "\n", "local cluster")
    return render_cluster_toml(config)


def stage_node_id(stage: int, rank: int = 0) -> str:
    """A local cluster's node id for (stage, rank): rank 0 is the stage's own name."""
    return f"stage-{stage}" if rank == 0 else f"stage-{stage}-rank-{rank}"


def stage_environment(environ: Mapping[str, str], stages: int, cpus: int) -> dict[str, str]:
    """A stage process's environment: this one's, with the CPU's cores shared between the
    stages for OpenBLAS (its idle threads spin: N stages with all the cores each spend much of
    the CPU waiting on each other), but every core for a pass that runs alone in the pipeline
    (``engine/stage_threads.py``), with idle threads that sleep at once rather than spin. An
    OPENBLAS_NUM_THREADS already set wins, and then no pass uses more."""
    env = dict(environ)
    if "OPENBLAS_NUM_THREADS" not in env:
        env["OPENBLAS_NUM_THREADS"] = str(max(1, cpus // stages))
        env.setdefault(SOLO_ENV, str(max(1, cpus)))
        env.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # 2^4 cycles of spinning, then sleep
    return env


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
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    port_range: PortRange = field(
        default_factory=lambda: parse_port_range(DEFAULT_TRANSPORT_PORT_RANGE)
    )
    """where the stages' and the coordinator's transport ports come from"""
    port_setting: str = "--transport-port-range"
    """how an exhausted range's error names the setting"""
    transport_backend: str = "tcp"
    tp: int = 1
    """tensor-parallel ranks per stage: one process each"""
    adapters: tuple[str, ...] = ()
    """``--adapter`` values: DIR (fused) or NAME=DIR (per request), written into the TOML"""
    operators: Mapping[str, str] = field(default_factory=dict)
    """``--operator`` values: the TOML's [operators], who may sign admin requests"""
    followers: list[list[subprocess.Popen[bytes]]] = field(default_factory=list, init=False)
    """each stage's ranks above 0 (``procs`` holds rank 0, the one that listens)"""
    restarts: list[int] = field(default_factory=list, init=False)
    """how often each stage was restarted"""
    key_files: dict[str, Path] = field(default_factory=dict, init=False)
    """each node's own key file (the TOML's [roster] lists their public halves)"""

    def _node_ids(self) -> list[str]:
        return [stage_node_id(i, r) for i in range(len(self.ranges)) for r in range(self.tp)]

    def __post_init__(self) -> None:
        try:
            # Stages first (the lowest free ports), then the coordinator's address.
            *ports, coordinator_port = free_ports_in(
                self.port_range, len(self.ranges) * self.tp + 1, setting=self.port_setting
            )
            self.node_ports = ports
            # Where each stage listens: its rank 0's port.
            self.ports = ports[:: self.tp]
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
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
        # Each node its own key, as on separate hosts; the roster lists every one.
        roster = {}
        for node_id in ["coordinator", *self._node_ids()]:
            path = self.workdir / "keys" / f"{node_id}.key"
            path.parent.mkdir(mode=0o700, exist_ok=True)
            roster[node_id] = write_new_node_key(path).public_text
            self.key_files[node_id] = path
        self.cluster_file = self.workdir / "cluster.toml"
        self.cluster_file.write_text(
            local_cluster_toml(
                self.ranges,
                self.node_ports,
                "mlxpp-local",
                coordinator_port=coordinator_port,
                transport_backend=self.transport_backend,
                port_range=self.port_range,
                tp=self.tp,
                adapters=self.adapters,
                roster=roster,
                operators=self.operators,
            )
        )
        self.restarts = [0 for _ in self.ranges]
        # When each stage's current process listened (None: not yet), for the restart policy.
        self._ready_at: list[float | None] = [None for _ in self.ranges]
        self._stopping = False
        #: what became ready when (the web console shows it)
        self.timeline = StartTimeline()

    def _stage_command(self, index: int, ready: Path, rank: int = 0) -> list[str]:
        cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve"]
        node = stage_node_id(index, rank)
        cmd += ["--distributed-config", str(self.cluster_file), "--node-id", node]
        cmd += ["--cluster-secret-file", str(self.secret_file), "--ready-file", str(ready)]
        cmd += ["--node-key-file", str(self.key_files[node])]
        if self.model:
            cmd += ["--model", self.model]
        if self.max_batch_size is not None:
            cmd += ["--max-batch-size", str(self.max_batch_size)]
        if self.kv_budget_bytes is not None:
            cmd += ["--kv-budget-bytes", str(self.kv_budget_bytes)]
        if self.cpu_weights is not None:
            cmd += ["--cpu-weights", self.cpu_weights]
        return [*cmd, "--log-level", self.log_level]

    def _ready_file(self, index: int) -> Path:
        return self.workdir / f"stage-{index}.ready"

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        """Start stage ``index``: its ranks above 0 (they wait for rank 0 in the ring), then
        rank 0, which listens once every rank has loaded its shard."""
        ready = self._ready_file(index)
        # A ready file left by an earlier process would pass for this one listening.
        ready.unlink(missing_ok=True)
        self._ready_at[index] = None
        env = stage_environment(os.environ, len(self.ranges) * self.tp, os.cpu_count() or 1)
        ranks = []
        for rank in range(1, self.tp):
            follower_ready = self.workdir / f"stage-{index}-rank-{rank}.ready"
            ranks.append(self._popen(self._stage_command(index, follower_ready, rank), env))
        while len(self.followers) <= index:
            self.followers.append([])
        self.followers[index] = ranks
        return self._popen(self._stage_command(index, ready), env)

    @staticmethod
    def _popen(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
        )

    def _stage_exited(self, index: int) -> int | None:
        """The exit status of the first of stage ``index``'s processes to exit (None: all
        run). A rank that exits takes its stage with it: the others are ended."""
        group = [self.procs[index], *self.followers[index]]
        codes = [p.poll() for p in group]
        exited = next((c for c in codes if c is not None), None)
        if exited is not None:
            for proc in group:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return exited

    def _listened(self, index: int) -> None:
        self._ready_at[index] = time.monotonic()
        address = self._ready_file(index).read_text().strip()
        print(f"stage {index} listening on {address}", file=sys.stderr)
        self.timeline.mark(f"stage {index} listening on {address}")

    def start_stages(self) -> None:
        """Start every stage in ascending order, each listening before the next starts."""
        for i in range(len(self.ranges)):
            proc = self._spawn(i)
            self.procs.append(proc)
            print(f"starting stage {i}/{len(self.ranges)} (pid {proc.pid})...", file=sys.stderr)
            deadline = time.monotonic() + STAGE_START_TIMEOUT_S
            while not self._ready_file(i).exists():
                if (code := self._stage_exited(i)) is not None:
                    raise TemporaryError(
                        f"stage {i} exited with status {code} before it listened; "
                        "see its error above"
                    )
                if time.monotonic() > deadline:
                    raise TemporaryError(
                        f"stage {i} did not listen within {STAGE_START_TIMEOUT_S}s"
                    )
                time.sleep(0.05)
            self._listened(i)

    @contextlib.asynccontextmanager
    async def supervision(self) -> AsyncIterator[None]:
        """Restart stages that exit while the body runs; on leaving, stop restarting (and wait
        for that) before anyone calls ``stop``."""
        task = spawn(self._supervise(), name="local-cluster-supervisor")
        try:
            yield
        finally:
            # Errors were logged when they happened; they must not hide the body's outcome.
            await stop_tasks(task, ignore_errors=True)

    async def _supervise(self) -> None:
        # One watcher per stage, so a stage slow to come back delays no other stage's restart.
        async with asyncio.TaskGroup() as group:
            for i in range(len(self.procs)):
                group.create_task(self._watch_stage(i), name=f"stage-{i}-watch")

    async def _watch_stage(self, index: int) -> None:
        failed_starts = 0
        while not self._stopping:
            proc = self.procs[index]
            while self._stage_exited(index) is None:
                await asyncio.sleep(SUPERVISE_POLL_S)
            ready_at = self._ready_at[index]
            served_s = 0.0 if ready_at is None else time.monotonic() - ready_at
            decision = self.restart_policy.after_exit(failed_starts, served_s)
            failed_starts = decision.failed_starts
            where = f"127.0.0.1:{self.ports[index]}"
            if decision.delay_s is None:
                log.error(
                    "stage %d (pid %d) exited with status %s after %d failed starts in a row; "
                    "not restarting it (%s stays down)",
                    index, proc.pid, proc.returncode, failed_starts, where,
                )  # fmt: skip
                return
            self.restarts[index] += 1
            log.warning(
                "stage %d (pid %d) exited with status %s; restarting it on %s in %.1fs "
                "(restart %d)",
                index, proc.pid, proc.returncode, where, decision.delay_s, self.restarts[index],
            )  # fmt: skip
            await asyncio.sleep(decision.delay_s)
            if self._stopping:
                return
            await self._restart(index)

    async def _restart(self, index: int) -> None:
        """Start stage ``index`` again and wait until it listens, exits or runs out of time."""
        try:
            proc = self._spawn(index)
        except OSError as e:
            # No process (fork failed): counts as a failed start, paced like any other.
            log.error("stage %d could not be restarted: %s", index, e)
            return
        self.procs[index] = proc
        print(f"restarted stage {index}/{len(self.ranges)} (pid {proc.pid})", file=sys.stderr)
        deadline = time.monotonic() + STAGE_START_TIMEOUT_S
        while self._stage_exited(index) is None:
            if self._ready_file(index).exists():
                self._listened(index)
                return
            if time.monotonic() > deadline:
                log.error(
                    "stage %d did not listen within %ss; ending it", index, STAGE_START_TIMEOUT_S
                )
                proc.kill()
                return
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        """Stop every stage, last first; SIGKILL what does not exit in 10 s."""
        self._stopping = True  # no restart from here on, whoever still runs
        # Rank 0 first: it tells its other ranks to stop as it closes.
        every = [*reversed(self.procs), *(p for ranks in self.followers for p in ranks)]
        for proc in every:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in every:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                proc.wait(remaining)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.followers.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def node_options(self, template: NodeOptions) -> NodeOptions:
        return replace(
            template,
            cluster_file=self.cluster_file,
            node_id="coordinator",
            secret_file=str(self.secret_file),
            node_key_file=str(self.key_files["coordinator"]),
            timeline=self.timeline,
        )
