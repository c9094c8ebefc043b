"""The sd_notify client speaks systemd's datagram protocol to a real AF_UNIX socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxppd.runtime.sd_notify import SdNotifier, watchdog_loop

PID = 4242


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


def _notifier(receiver: NotifySocket, **extra: str) -> SdNotifier:
    return SdNotifier.from_environ({"NOTIFY_SOCKET": receiver.env_value, **extra}, PID)


def test_ready_sends_ready_and_a_status(systemd_socket: NotifySocket) -> None:
    notifier = _notifier(systemd_socket)
    assert notifier.enabled
    notifier.ready("serving on 127.0.0.1:8080")
    assert systemd_socket.receive() == {"READY": "1", "STATUS": "serving on 127.0.0.1:8080"}
    notifier.close()


def test_status_is_one_line_even_when_the_text_is_not(systemd_socket: NotifySocket) -> None:
    notifier = _notifier(systemd_socket)
    notifier.status("loading model\nlayers 0-14\r\nstage 0")
    assert systemd_socket.receive_raw() == "STATUS=loading model layers 0-14 stage 0"
    notifier.close()


def test_reloading_carries_the_monotonic_clock_in_microseconds(
    systemd_socket: NotifySocket,
) -> None:
    notifier = _notifier(systemd_socket)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading("reloading /etc/mlxpp")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    message = systemd_socket.receive()
    assert message["RELOADING"] == "1"
    assert message["STATUS"] == "reloading /etc/mlxpp"
    assert before <= int(message["MONOTONIC_USEC"]) <= after
    notifier.close()


def test_stopping_and_watchdog(systemd_socket: NotifySocket) -> None:
    notifier = _notifier(systemd_socket, WATCHDOG_USEC="30000000", WATCHDOG_PID=str(PID))
    assert notifier.watchdog_interval_s == 15.0
    notifier.watchdog()
    assert systemd_socket.receive_raw() == "WATCHDOG=1"
    notifier.stopping("draining 3 requests")
    assert systemd_socket.receive() == {"STOPPING": "1", "STATUS": "draining 3 requests"}
    notifier.close()


def test_without_notify_socket_every_method_is_a_no_op() -> None:
    notifier = SdNotifier.from_environ({"WATCHDOG_USEC": "30000000"}, PID)
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    notifier.ready("x")
    notifier.status("x")
    notifier.reloading("x")
    notifier.watchdog()
    notifier.stopping("x")
    notifier.close()


def test_a_watchdog_meant_for_another_process_is_off(short_dir: Path) -> None:
    receiver = _path_socket(short_dir)
    notifier = _notifier(receiver, WATCHDOG_USEC="30000000", WATCHDOG_PID=str(PID + 1))
    assert notifier.enabled
    assert notifier.watchdog_interval_s is None
    notifier.watchdog()
    notifier.status("after the ping that was not sent")
    assert receiver.receive_raw() == "STATUS=after the ping that was not sent"
    notifier.close()
    receiver.close()


def test_without_watchdog_pid_the_watchdog_is_ours() -> None:
    notifier = SdNotifier.from_environ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1000000"}, PID)
    assert notifier.watchdog_interval_s == 0.5


def test_an_unusable_notify_socket_value_disables_notification() -> None:
    assert not SdNotifier.from_environ({"NOTIFY_SOCKET": "vsock:2:1234"}, PID).enabled


def test_a_vanished_socket_never_raises_and_warns_once(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = _path_socket(short_dir)
    notifier = _notifier(receiver, WATCHDOG_USEC="2000000")
    receiver.close()
    os.unlink(short_dir / "notify")
    with caplog.at_level(logging.DEBUG, logger="mlxppd.runtime.sd_notify"):
        notifier.ready("up")
        notifier.watchdog()
        notifier.watchdog()
        notifier.stopping("down")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "cannot notify systemd" in warnings[0].getMessage()
    notifier.close()


def test_watchdog_loop_pings_at_the_interval_until_stopped(short_dir: Path) -> None:
    receiver = _path_socket(short_dir)
    # WATCHDOG_USEC 0.2 s: a ping every 0.1 s.
    notifier = _notifier(receiver, WATCHDOG_USEC="200000", WATCHDOG_PID=str(PID))
    assert notifier.watchdog_interval_s == pytest.approx(0.1)
    arrivals: list[tuple[float, str]] = []

    async def listen() -> None:
        loop = asyncio.get_running_loop()
        receiver.sock.setblocking(False)
        while True:
            data = await loop.sock_recv(receiver.sock, 4096)
            arrivals.append((loop.time(), data.decode("utf-8")))

    async def run() -> float:
        listener = asyncio.create_task(listen(), name="listener")
        stop = asyncio.Event()
        pinger = asyncio.create_task(watchdog_loop(notifier, stop), name="watchdog")
        await asyncio.sleep(0.55)
        stop.set()
        stopped_at = time.monotonic()
        await asyncio.wait_for(pinger, timeout=5)
        stop_latency = time.monotonic() - stopped_at
        await asyncio.sleep(0.05)  # let the last datagram arrive
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
        return stop_latency

    stop_latency = asyncio.run(run())
    assert {payload for _, payload in arrivals} == {"WATCHDOG=1"}
    # One ping at once, then one per 0.1 s: six in 0.55 s on an idle machine; never faster.
    assert 3 <= len(arrivals) <= 6
    gaps = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert min(gaps) >= 0.08
    assert stop_latency < 1.0
    # Nothing is sent once the loop has returned.
    time.sleep(0.25)
    assert receiver.pending() == []
    notifier.close()
    receiver.close()


def test_watchdog_loop_returns_at_once_without_a_watchdog() -> None:
    notifier = SdNotifier.from_environ({}, PID)

    async def run() -> None:
        await asyncio.wait_for(watchdog_loop(notifier, asyncio.Event()), timeout=1)

    asyncio.run(run())
