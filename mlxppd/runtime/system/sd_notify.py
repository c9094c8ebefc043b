"""systemd's notify protocol (sd_notify(3)), through systemd-python where it is installed.

Under ``Type=notify`` systemd hands the service ``NOTIFY_SOCKET``; the service sends
newline-separated ``KEY=VALUE`` datagrams there: ``READY=1`` once it serves, ``STATUS=`` for
``systemctl status``, ``RELOADING=1`` / ``STOPPING=1`` around a reload or a drain, and
``WATCHDOG=1`` at least every ``WATCHDOG_USEC``. Without ``NOTIFY_SOCKET`` (a shell, launchd,
tests) every method does nothing, so callers never branch on how they were started.

With systemd-python (the ``mlxpp[systemd]`` extra) the datagrams go through libsystemd's
``sd_notify`` (``systemd.daemon.notify``); without it, or when the environment handed in is not
the process's own (libsystemd reads ``NOTIFY_SOCKET`` from the process environment), a
pure-Python client sends the same datagrams itself.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

__all__ = ["NOTIFY_VARIABLES", "SYSTEMD_PYTHON", "SdNotifier", "watchdog_loop"]

log = logging.getLogger(__name__)

# The variables systemd sets for the main process; a child process should not inherit them.
NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# A datagram to a full notify queue must not stall the event loop for long.
_SEND_TIMEOUT_S = 1.0

# SdNotifier.backend: who sends the datagrams.
SYSTEMD_PYTHON = "systemd-python"
_SOCKET = "socket"

# systemd.daemon.notify(message) -> True when sent, False when NOTIFY_SOCKET is unset; OSError
# when sending failed.
NotifySender = Callable[[str], bool]


def _monotonic_usec() -> int:
    # systemd compares MONOTONIC_USEC with its own CLOCK_MONOTONIC reading.
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def _one_line(text: str) -> str:
    # A newline would end the STATUS= assignment and start a bogus one.
    return " ".join(text.splitlines())


def _socket_address(value: str) -> str | None:
    if value.startswith("@"):
        return "\0" + value[1:]  # Linux abstract namespace
    if value.startswith("/"):
        return value
    return None


def _systemd_daemon_notify() -> NotifySender | None:
    try:
        daemon = importlib.import_module("systemd.daemon")
    except ImportError:
        return None
    notify: NotifySender = daemon.notify
    return notify


def _watchdog_usec(environ: Mapping[str, str], pid: int) -> int | None:
    raw = environ.get("WATCHDOG_USEC")
    if not raw:
        return None
    owner = environ.get("WATCHDOG_PID")
    # The variables leak into children; only the process they were meant for pings.
    if owner is not None and owner.strip() != str(pid):
        return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw)
        return None
    return usec if usec > 0 else None


class SdNotifier:
    """Sends sd_notify datagrams to systemd; does nothing when not started by systemd."""

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
        monotonic_usec: Callable[[], int] = _monotonic_usec,
        sender: NotifySender | None = None,
    ) -> None:
        """``sender`` (``systemd.daemon.notify``) sends instead of the built-in client; it must
        send to ``address``, which libsystemd takes from the process's ``NOTIFY_SOCKET``."""
        self._address = address
        self._watchdog_usec = watchdog_usec if address is not None else None
        self._monotonic_usec = monotonic_usec
        self._sender = sender if address is not None else None
        self._socket: socket.socket | None = None
        self._failing = False

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str],
        pid: int,
        *,
        systemd_python: bool = True,
    ) -> SdNotifier:
        """The notifier systemd's environment asks for; ``pid`` is this process's id.

        It sends through systemd-python when that is installed, ``systemd_python`` allows it
        and ``environ`` hands in the process's own ``NOTIFY_SOCKET``; otherwise through the
        built-in client.
        """
        raw = environ.get("NOTIFY_SOCKET")
        if not raw:
            return cls(None)
        address = _socket_address(raw)
        if address is None:
            log.warning("ignoring NOTIFY_SOCKET=%r: only paths and @abstract names work", raw)
            return cls(None)
        sender = None
        # libsystemd sends to the process's NOTIFY_SOCKET, whatever ``environ`` says.
        if systemd_python and os.environ.get("NOTIFY_SOCKET") == raw:
            sender = _systemd_daemon_notify()
        return cls(address, watchdog_usec=_watchdog_usec(environ, pid), sender=sender)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def backend(self) -> str | None:
        """``"systemd-python"`` or ``"socket"`` (the built-in client); None when disabled."""
        if self._address is None:
            return None
        return SYSTEMD_PYTHON if self._sender is not None else _SOCKET

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half the watchdog timeout, as sd_watchdog_enabled(3) advises."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def ready(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={_one_line(status)}")

    def status(self, text: str) -> None:
        self._send(f"STATUS={_one_line(text)}")

    def reloading(self, status: str) -> None:
        # systemd >= 253 needs the timestamp to tell this reload from an older one.
        self._send(
            f"RELOADING=1\nSTATUS={_one_line(status)}\nMONOTONIC_USEC={self._monotonic_usec()}"
        )

    def stopping(self, status: str) -> None:
        self._send(f"STOPPING=1\nSTATUS={_one_line(status)}")

    def watchdog(self) -> None:
        if self._watchdog_usec is not None:
            self._send("WATCHDOG=1")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _send(self, message: str) -> None:
        if self._address is None:
            return
        try:
            if self._sender is not None:
                if not self._sender(message):
                    raise OSError("NOTIFY_SOCKET is no longer set in the process environment")
            else:
                if self._socket is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    sock.settimeout(_SEND_TIMEOUT_S)
                    self._socket = sock
                self._socket.sendto(message.encode("utf-8"), self._address)
        except OSError as exc:
            # Once per outage: a vanished socket would otherwise log at every watchdog ping.
            level = logging.DEBUG if self._failing else logging.WARNING
            log.log(level, "cannot notify systemd at %r: %s", self._address, exc)
            self._failing = True
        else:
            self._failing = False


async def watchdog_loop(notifier: SdNotifier, stop: asyncio.Event) -> None:
    """Ping ``WATCHDOG=1`` every ``watchdog_interval_s`` until ``stop`` is set.

    It runs on the event loop on purpose: a blocked loop stops the pings and systemd restarts
    the service.
    """
    interval = notifier.watchdog_interval_s
    if interval is None:
        return
    while not stop.is_set():
        notifier.watchdog()
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except TimeoutError:
            pass
