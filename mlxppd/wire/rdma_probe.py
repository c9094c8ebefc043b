"""Probing the OS for the zero-copy primitive the ``rdma`` backend's fast path stands for.

Linux: the ``kernel.io_uring_disabled`` knob (6.6+), then a real ``io_uring_setup`` system call,
which also catches seccomp / LSM policies the knob does not show. macOS: kqueue. Anything else:
unsupported. The decision logic is pure (``probe_linux``, ``probe_macos``), fed by small
functions that touch the system, so every reason can be tested on any machine.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import select
import sys
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "IO_URING_DISABLED_PATH",
    "IO_URING_SETUP_SYSCALL",
    "ProbeResult",
    "call_io_uring_setup",
    "os_family",
    "probe_acceleration",
    "probe_linux",
    "probe_macos",
]

IO_URING_DISABLED_PATH = "/proc/sys/kernel/io_uring_disabled"
#: io_uring_setup's number in the unified syscall table (x86, arm, arm64, riscv, ppc, s390).
IO_URING_SETUP_SYSCALL = 425
# Architectures whose table is offset or different, where 425 would be another call.
_OTHER_SYSCALL_TABLES = ("mips", "alpha", "ia64", "parisc", "sparc")
_IO_URING_PARAMS_BYTES = 120  # sizeof(struct io_uring_params)


@dataclass(frozen=True)
class ProbeResult:
    """What the probe found; ``reason`` is the ``os=..., driver=...: ...`` text of
    docs/protocol.md."""

    os: str
    driver: str
    detail: str
    accelerated: bool

    @property
    def reason(self) -> str:
        return f"os={self.os}, driver={self.driver}: {self.detail}"


def os_family(platform_name: str = sys.platform) -> str:
    """``linux``, ``macos``, or the platform name as Python reports it."""
    if platform_name.startswith("linux"):
        return "linux"
    return "macos" if platform_name == "darwin" else platform_name


def probe_linux(
    read_knob: Callable[[], str | None], io_uring_setup: Callable[[], int], machine: str = ""
) -> ProbeResult:
    """Decide from the knob's text (None: absent) and the syscall's errno (0: it worked)."""

    def fail(driver: str, detail: str) -> ProbeResult:
        return ProbeResult("linux", driver, detail, False)

    if machine.startswith(_OTHER_SYSCALL_TABLES):
        return fail("unsupported", f"no io_uring_setup syscall number is known for {machine}")
    knob = read_knob()
    knob = knob.strip() if knob is not None else None
    if knob == "2":
        return fail("io_uring_disabled", "kernel.io_uring_disabled=2 disables io_uring for all")
    # With knob 1 only members of kernel.io_uring_group may create rings: the syscall tells.
    try:
        err = io_uring_setup()
    except OSError as exc:
        return fail("io_uring_unavailable", f"cannot make system calls through libc: {exc}")
    if err == 0:
        return ProbeResult("linux", "io_uring", "io_uring_setup succeeded", True)
    if err == errno.ENOSYS:
        return fail("io_uring_missing", "kernel does not export io_uring_setup (ENOSYS)")
    if err in (errno.EPERM, errno.EACCES):
        why = (
            "kernel.io_uring_disabled=1 limits it to kernel.io_uring_group"
            if knob == "1"
            else "blocked by seccomp or a security module"
        )
        return fail("io_uring_denied", f"io_uring_setup refused ({errno.errorcode[err]}): {why}")
    name = errno.errorcode.get(err, str(err))
    return fail("io_uring_unavailable", f"io_uring_setup failed ({name})")


def probe_macos(has_kqueue: bool) -> ProbeResult:
    """kqueue is the primitive; without it (never seen in practice) there is no fast path."""
    if has_kqueue:
        return ProbeResult("macos", "kqueue", "kqueue available", True)
    return ProbeResult("macos", "kqueue_missing", "select.kqueue is not available", False)


def _read_knob() -> str | None:
    try:
        with open(IO_URING_DISABLED_PATH, encoding="ascii") as f:
            return f.read(16)
    except FileNotFoundError:
        return None  # kernels before 6.6 have no knob
    except OSError:
        return None  # unreadable knob: let the syscall decide


def call_io_uring_setup() -> int:
    """Create and at once close a one-entry io_uring; 0 on success, else the errno."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError) as exc:
        raise OSError(f"no syscall() in libc: {exc}") from None
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_uint, ctypes.c_void_p]
    params = ctypes.create_string_buffer(_IO_URING_PARAMS_BYTES)  # zeroed: default flags
    fd = syscall(IO_URING_SETUP_SYSCALL, 1, ctypes.cast(params, ctypes.c_void_p))
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


def probe_acceleration(platform_name: str = sys.platform) -> ProbeResult:
    """Probe this machine (the ``rdma`` backend calls this once, at bind or first connect)."""
    family = os_family(platform_name)
    if family == "linux":
        return probe_linux(_read_knob, call_io_uring_setup, platform.machine())
    if family == "macos":
        return probe_macos(hasattr(select, "kqueue"))
    return ProbeResult(family, "unsupported", "no zero-copy primitive on this platform", False)
