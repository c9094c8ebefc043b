"""One long-lived process (on a host's network namespace, or this host) that runs
``mlxppctl`` commands and HTTP GETs for a test, so a test that polls a cluster's status many
times pays for Python and ``mlxppctl``'s imports once, not on every poll.

Each command runs ``mlxppd.cli.mlxppctl_main.main`` (what the ``mlxppctl`` script runs) with
its stdout and stderr captured; the answer is a ``CompletedProcess`` as ``subprocess.run``
would give. Commands whose run matters to a test (their exit, their human-readable text) may
still be run as their own process; this is for reading state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

LOOP = r"""
import contextlib, io, json, sys
import httpx
from mlxppd.cli.mlxppctl_main import main
for line in sys.stdin:
    ask = json.loads(line)
    out, err, rc = io.StringIO(), io.StringIO(), 0
    if "get" in ask:
        try:
            out.write(httpx.get(ask["get"], timeout=30).text)
        except Exception as exc:  # the caller reads an error as a failed command
            err.write(repr(exc))
            rc = 1
    else:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(ask["ctl"])
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 1
    sys.stdout.write(json.dumps({"rc": rc, "stdout": out.getvalue(),
                                 "stderr": err.getvalue()}) + "\n")
    sys.stdout.flush()
"""


class CtlRunner:
    """Runs ``mlxppctl`` argv (without the program name) in one process started lazily;
    ``netns``: the network namespace it runs in (None: this host's)."""

    def __init__(self, netns: str | None = None, env: dict[str, str] | None = None) -> None:
        self.netns, self.env = netns, env
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def _process(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
            self._proc = subprocess.Popen(
                [*prefix, sys.executable, "-c", LOOP],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env,
            )  # fmt: skip
        return self._proc

    def _ask(self, argv: list[str], ask: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        with self._lock:
            proc = self._process()
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(ask) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the ctl runner ended (exit {proc.wait(10)})")
        answer = json.loads(line)
        return subprocess.CompletedProcess(argv, answer["rc"], answer["stdout"], answer["stderr"])

    def ctl(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """``mlxppctl *argv``, as ``subprocess.run(..., capture_output=True, text=True)``."""
        return self._ask(["mlxppctl", *argv], {"ctl": list(argv)})

    def get(self, url: str) -> str:
        """The body of ``GET url``."""
        done = self._ask(["GET", url], {"get": url})
        assert done.returncode == 0, done.stderr
        return done.stdout

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                if self._proc.stdin is not None:
                    self._proc.stdin.close()
                try:
                    self._proc.wait(30)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(10)
                if self._proc.stdout is not None:
                    self._proc.stdout.close()
                self._proc = None
