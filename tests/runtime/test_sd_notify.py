"""The sd_notify client speaks systemd's datagram protocol to a real AF_UNIX socket.

Every conversation runs twice: through systemd-python (libsystemd's sd_notify, reading
NOTIFY_SOCKET from the process environment) and through the built-in client.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxppd.runtime.system.sd_notify import SYSTEMD_PYTHON, SdNotifier, watchdog_loop

PID = 4242
# Generous: only a notifier that never sends (or never stops) runs into it.
DEADLINE_S = 60.0


class NotifySocket:
    """The receiving end systemd would hold: a datagram socket bound to a path or a name."""

    def __init__(self, address: str, env_value: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(5.0)
        self.env_value = env_value

    def receive(self) -> dict[str, str]:
        data = self.sock.recv(4096).decode("utf-8")
        return dict(line.split("=", 1) for line in data.split("\n"))

    def receive_raw(self) -> str:
        return self.sock.recv(4096).decode("utf-8")

    def pending(self) -> list[str]:
        """Every datagram already queued, without waiting."""
        self.sock.setblocking(False)
        out = []
        try:
            while True:
                out.append(self.sock.recv(4096).decode("utf-8"))
        except BlockingIOError:
            return out
        finally:
            self.sock.settimeout(5.0)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def short_dir() -> Iterator[Path]:
    # AF_UNIX paths are limited to ~108 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="sdn-", dir="/tmp") as path:
        yield Path(path)


def _path_socket(directory: Path) -> NotifySocket:
    path = str(directory / "notify")
    return NotifySocket(path, path)


def _abstract_socket() -> NotifySocket:
    name = f"mlxpp-test-{os.getpid()}-{time.monotonic_ns()}"
    return NotifySocket("\0" + name, "@" + name)


@pytest.fixture(params=["path", "abstract"])
def systemd_socket(request: pytest.FixtureRequest, short_dir: Path) -> Iterator[NotifySocket]:
    if request.param == "abstract" and not sys.platform.startswith("linux"):
        pytest.skip("abstract AF_UNIX names exist only on Linux")
    receiver = _path_socket(short_dir) if request.param == "path" else _abstract_socket()
    yield receiver
    receiver.close()


class Backend:
    """Builds notifiers that send the one way this test run asks for."""

    def __init__(self, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.name = name
        self._monkeypatch = monkeypatch
        self.calls: list[str] = []  # what went through systemd.daemon.notify
        if name == SYSTEMD_PYTHON:
            daemon = _systemd_daemon()
            real = daemon.notify

            def spy(message: str, *args: Any, **kwargs: Any) -> bool:
                self.calls.append(message)
                result: bool = real(message, *args, **kwargs)
                return result

            monkeypatch.setattr(daemon, "notify", spy)

    def notifier(self, receiver: NotifySocket, **extra: str) -> SdNotifier:
        environ = {"NOTIFY_SOCKET": receiver.env_value, **extra}
        if self.name == SYSTEMD_PYTHON:
            # libsystemd reads NOTIFY_SOCKET from the process environment.
            self._monkeypatch.setenv("NOTIFY_SOCKET", receiver.env_value)
            notifier = SdNotifier.from_environ(environ, PID)
        else:
            notifier = SdNotifier.from_environ(environ, PID, systemd_python=False)
        assert notifier.backend == self.name
        return notifier

    def check_sent(self, count: int) -> None:
        """Every one of ``count`` messages went through systemd-python when that is tested."""
        assert len(self.calls) == (count if self.name == SYSTEMD_PYTHON else 0)


def _systemd_daemon() -> Any:
    try:
        return importlib.import_module("systemd.daemon")
    except ImportError:
        pytest.skip(
            "systemd-python is not installed: apt-get install libsystemd-dev pkg-config, "
            "then pip install 'mlxpp[systemd]'"
        )


@pytest.fixture(params=[SYSTEMD_PYTHON, "socket"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Backend:
    return Backend(request.param, monkeypatch)


def test_ready_sends_ready_and_a_status(systemd_socket: NotifySocket, backend: Backend) -> None:
    notifier = backend.notifier(systemd_socket)
    assert notifier.enabled
    notifier.ready("serving on 127.0.0.1:8080")
    assert systemd_socket.receive() == {"READY": "1", "STATUS": "serving on 127.0.0.1:8080"}
    backend.check_sent(1)
    notifier.close()


def test_status_is_one_line_even_when_the_text_is_not(
    systemd_socket: NotifySocket, backend: Backend
) -> None:
    notifier = backend.notifier(systemd_socket)
    notifier.status("loading model\nlayers 0-14\r\nstage 0")
    assert systemd_socket.receive_raw() == "STATUS=loading model layers 0-14 stage 0"
    backend.check_sent(1)
    notifier.close()


def test_reloading_carries_the_monotonic_clock_in_microseconds(
    systemd_socket: NotifySocket, backend: Backend
) -> None:
    notifier = backend.notifier(systemd_socket)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading("reloading /etc/mlxpp")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    message = systemd_socket.receive()
    assert message["RELOADING"] == "1"
    assert message["STATUS"] == "reloading /etc/mlxpp"
    assert before <= int(message["MONOTONIC_USEC"]) <= after
    backend.check_sent(1)
    notifier.close()


def test_stopping_and_watchdog(systemd_socket: NotifySocket, backend: Backend) -> None:
    notifier = backend.notifier(systemd_socket, WATCHDOG_USEC="30000000", WATCHDOG_PID=str(PID))
    assert notifier.watchdog_interval_s == 15.0
    notifier.watchdog()
    assert systemd_socket.receive_raw() == "WATCHDOG=1"
    notifier.stopping("draining 3 requests")
    assert systemd_socket.receive() == {"STOPPING": "1", "STATUS": "draining 3 requests"}
    backend.check_sent(2)
    notifier.close()


def test_without_notify_socket_every_method_is_a_no_op() -> None:
    notifier = SdNotifier.from_environ({"WATCHDOG_USEC": "30000000"}, PID)
    assert not notifier.enabled
    assert notifier.backend is None
    assert notifier.watchdog_interval_s is None
    notifier.ready("x")
    notifier.status("x")
    notifier.reloading("x")
    notifier.watchdog()
    notifier.stopping("x")
    notifier.close()


def test_a_watchdog_meant_for_another_process_is_off(short_dir: Path, backend: Backend) -> None:
    receiver = _path_socket(short_dir)
    notifier = backend.notifier(receiver, WATCHDOG_USEC="30000000", WATCHDOG_PID=str(PID + 1))
    assert notifier.enabled
    assert notifier.watchdog_interval_s is None
    notifier.watchdog()
    notifier.status("after the ping that was not sent")
    assert receiver.receive_raw() == "STATUS=after the ping that was not sent"
    backend.check_sent(1)
    notifier.close()
    receiver.close()


def test_without_watchdog_pid_the_watchdog_is_ours() -> None:
    notifier = SdNotifier.from_environ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1000000"}, PID)
    assert notifier.watchdog_interval_s == 0.5


def test_an_unusable_notify_socket_value_disables_notification() -> None:
    assert not SdNotifier.from_environ({"NOTIFY_SOCKET": "vsock:2:1234"}, PID).enabled


def test_systemd_python_only_sends_to_the_process_notify_socket(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # libsystemd would send to the process's NOTIFY_SOCKET, not to the one handed in.
    _systemd_daemon()
    monkeypatch.setenv("NOTIFY_SOCKET", str(short_dir / "elsewhere"))
    notifier = SdNotifier.from_environ({"NOTIFY_SOCKET": str(short_dir / "notify")}, PID)
    assert notifier.backend == "socket"
    monkeypatch.setenv("NOTIFY_SOCKET", str(short_dir / "notify"))
    notifier = SdNotifier.from_environ({"NOTIFY_SOCKET": str(short_dir / "notify")}, PID)
    assert notifier.backend == SYSTEMD_PYTHON


def test_a_vanished_socket_never_raises_and_warns_once(
    short_dir: Path, caplog: pytest.LogCaptureFixture, backend: Backend
) -> None:
    receiver = _path_socket(short_dir)
    notifier = backend.notifier(receiver, WATCHDOG_USEC="2000000")
    receiver.close()
    os.unlink(short_dir / "notify")
    with caplog.at_level(logging.DEBUG, logger="mlxppd.runtime.system.sd_notify"):
        notifier.ready("up")
        notifier.watchdog()
        notifier.watchdog()
        notifier.stopping("down")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "cannot notify systemd" in warnings[0].getMessage()
    backend.check_sent(4)
    notifier.close()


def test_watchdog_loop_pings_at_the_interval_until_stopped(
    short_dir: Path, backend: Backend
) -> None:
    receiver = _path_socket(short_dir)
    # WATCHDOG_USEC 0.2 s: a ping every 0.1 s.
    notifier = backend.notifier(receiver, WATCHDOG_USEC="200000", WATCHDOG_PID=str(PID))
    assert notifier.watchdog_interval_s == pytest.approx(0.1)
    # When each ping was sent, on the loop's clock (the datagrams queue up in the socket).
    pinged_at: list[float] = []
    ping = notifier.watchdog

    def recorded_ping() -> None:
        pinged_at.append(asyncio.get_running_loop().time())
        ping()

    notifier.watchdog = recorded_ping  # type: ignore[method-assign]

    async def run() -> None:
        stop = asyncio.Event()
        pinger = asyncio.create_task(watchdog_loop(notifier, stop), name="watchdog")
        # Wait for pings rather than for a time, so a slow machine only makes it wait longer.
        deadline = asyncio.get_running_loop().time() + DEADLINE_S
        while len(pinged_at) < 4 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(pinger, timeout=DEADLINE_S)

    asyncio.run(run())
    assert len(pinged_at) >= 4, "the watchdog loop stopped pinging"
    # Never faster than the interval (the loop's timers may fire a clock tick early).
    gaps = [b - a for a, b in zip(pinged_at, pinged_at[1:], strict=False)]
    assert min(gaps) >= 0.1 - 0.01
    # Every ping arrived; nothing is sent once the loop has returned.
    assert [receiver.receive_raw() for _ in pinged_at] == ["WATCHDOG=1"] * len(pinged_at)
    time.sleep(0.25)
    assert receiver.pending() == []
    backend.check_sent(len(pinged_at))
    notifier.close()
    receiver.close()


def test_watchdog_loop_returns_when_stopped_without_waiting_out_the_interval(
    short_dir: Path,
) -> None:
    receiver = _path_socket(short_dir)
    # A ping every 300 s: a loop that only looked at ``stop`` between pings would run into
    # the (much shorter) deadline below.
    notifier = SdNotifier.from_environ(
        {"NOTIFY_SOCKET": receiver.env_value, "WATCHDOG_USEC": "600000000"},
        PID,
        systemd_python=False,
    )

    async def run() -> None:
        stop = asyncio.Event()
        pinger = asyncio.create_task(watchdog_loop(notifier, stop), name="watchdog")
        await asyncio.sleep(0)  # the first ping goes out at once
        stop.set()
        await asyncio.wait_for(pinger, timeout=DEADLINE_S)

    asyncio.run(run())
    assert receiver.receive_raw() == "WATCHDOG=1"
    assert receiver.pending() == []
    notifier.close()
    receiver.close()


def test_watchdog_loop_returns_at_once_without_a_watchdog() -> None:
    notifier = SdNotifier.from_environ({}, PID)

    async def run() -> None:
        await asyncio.wait_for(watchdog_loop(notifier, asyncio.Event()), timeout=DEADLINE_S)

    asyncio.run(run())
