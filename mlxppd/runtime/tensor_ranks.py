"""``mlxppd generate --tp-size T``: T rank processes on this host, joined by MLX's ring backend
over loopback. Each runs the same generation on its shard of every stage (the same program on
every rank, as mlx-lm's own tensor parallelism runs); rank 0 prints, the others keep quiet
unless one fails. A rank that dies leaves the others waiting in a collective forever, so the
launcher ends them all when any one exits with an error."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from mlxppd.engine.tensor_parallel import hostfile
from mlxppd.runtime.local_cluster import free_port

__all__ = ["is_rank_process", "launch_ranks"]

#: a rank process reads its rank and the ring's addresses from MLX's own launch variables
RANK_ENV = "MLX_RANK"
HOSTFILE_ENV = "MLX_HOSTFILE"
_POLL_S = 0.1


def is_rank_process(environ: Mapping[str, str]) -> bool:
    """Whether this process is one rank of a tensor-parallel run (the launcher is not)."""
    return RANK_ENV in environ and HOSTFILE_ENV in environ


def launch_ranks(argv: Sequence[str], tp: int, seed: int | None) -> int:
    """Run ``mlxppd <argv>`` as ``tp`` ranks; the exit status of the run (0: all succeeded).
    ``seed``: every rank samples with it (one is drawn when None), so they draw alike."""
    seed = seed if seed is not None else secrets.randbits(31)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="mlxpp-tp-") as tmp:
        hosts = Path(tmp) / "hostfile.json"
        hosts.write_text(hostfile([f"127.0.0.1:{free_port()}" for _ in range(tp)]))
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path | None] = []
        for rank in range(tp):
            env = {**os.environ, RANK_ENV: str(rank), HOSTFILE_ENV: str(hosts)}
            # The ranks share this host's cores: one BLAS thread each unless told otherwise.
            env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, cores // tp)))
            log = None if rank == 0 else Path(tmp) / f"rank-{rank}.log"
            logs.append(log)
            # Rank 0 speaks for the run; the others' output is the same, kept only for errors.
            with contextlib.ExitStack() as files:
                err = files.enter_context(log.open("wb")) if log is not None else None
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", *argv,
                         "--seed", str(seed)],
                        env=env,
                        stdout=None if rank == 0 else subprocess.DEVNULL,
                        stderr=err,
                    )
                )  # fmt: skip
        try:
            return _wait(procs, logs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _wait(procs: list[subprocess.Popen[bytes]], logs: list[Path | None]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank = failed[0]
            log = logs[rank]
            if log is not None and log.exists():
                tail = log.read_text(errors="replace").splitlines()[-20:]
                print(f"rank {rank} failed:", *tail, sep="\n", file=sys.stderr)
            return int(codes[rank] or 1)
        if all(code == 0 for code in codes):
            return 0
        time.sleep(_POLL_S)
