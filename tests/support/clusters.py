"""Start a real local cluster (``mlxppd serve --pp-size N``) for a test, and stop it cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunningCluster:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    stage_pids: list[int] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "State:\tZ" in status


def start_cluster(
    tmp: Path, env: dict[str, str], *flags: str, timeout: float = 240.0
) -> RunningCluster:
    ready = tmp / "coordinator.ready"
    log_path = tmp / "cluster.log"
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--port", "0"]
    cmd += ["--ready-file", str(ready), *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"cluster did not start:\n{log_path.read_text()}")
        time.sleep(0.1)
    pids = [
        int(p) for p in re.findall(r"starting stage \d+/\d+ \(pid (\d+)\)", log_path.read_text())
    ]
    return RunningCluster(proc, ready.read_text().strip(), log_path, pids)


def wait_gone(pids: list[int], timeout: float = 120.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not process_gone(p)]
        time.sleep(0.1)
    return alive


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def stage_port_and_pid(cluster: RunningCluster, stage: int) -> tuple[int, int]:
    """Where stage ``stage`` listens, and its process, from the cluster's log."""
    log = cluster.log()
    ports = dict(re.findall(r"stage (\d+) \(\S+\) serving layers \d+-\d+ on [^\s]+:(\d+)", log))
    pids = dict(re.findall(r"starting stage (\d+)/\d+ \(pid (\d+)\)", log))
    return int(ports[str(stage)]), int(pids[str(stage)])


def restarted_stage_pids(cluster: RunningCluster, stage: int) -> list[int]:
    """The processes the local cluster started again for stage ``stage``, oldest first."""
    found = re.findall(r"restarted stage (\d+)/\d+ \(pid (\d+)\)", cluster.log())
    return [int(pid) for s, pid in found if int(s) == stage]


def listens_on(pid: int, port: int) -> bool:
    """True when process ``pid`` holds a TCP socket listening on ``port`` (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 is the inode.
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(fields[9])
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except (FileNotFoundError, PermissionError):
        return False
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False
