"""mlx's allocator, seen and kept in bounds on a stage process.

mlx keeps freed buffers for reuse (its cache) up to its memory limit. A serving stage sees every
prompt length, so the cache fills with buffers of sizes seldom asked again: a soak's stages grew
7-10 % in 20 minutes with nothing leaking. ``CacheKeeper`` gives the cache back when the stage
has stayed idle a moment and caps it while busy, and keeps glibc from holding what mlx frees
(``bound_malloc``)."""

from __future__ import annotations

import ctypes
import sys

import mlx.core as mx

from mlxppd.core.protocol.control import MlxMemory

#: the cache a busy stage keeps at most: enough for a decode step's buffers (KiB to a few MiB,
#: the hot path) to be reused; a prefill chunk's larger ones are allocated afresh, which costs
#: little beside the chunk's compute. At 256 MiB a soak's stages filled it and held it.
DEFAULT_CACHE_LIMIT_BYTES = 64 << 20
#: glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8
#: buffers from this size up are mapped on their own and unmapped when freed
_MMAP_THRESHOLD_BYTES = 256 << 10


def bound_malloc() -> bool:
    """Keep freed memory from staying in the process (glibc only; False elsewhere).

    mlx frees what its cache does not keep with ``free``; glibc then raises its mmap threshold
    to the size of each large buffer freed (up to 32 MiB), so later buffers of every prompt
    length come from the heap, which fragments and is seldom returned: RSS creeps with
    nothing leaking. A fixed threshold keeps large buffers mapped (returned at ``free``), and
    two arenas stop each thread that ever allocated from holding its own heap."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_ARENA_MAX, 2)
    )


def memory_now() -> MlxMemory:
    """The allocator's counters now (cheap reads; safe from any thread)."""
    return MlxMemory(
        active_bytes=mx.get_active_memory(),
        cache_bytes=mx.get_cache_memory(),
        peak_bytes=mx.get_peak_memory(),
    )


class CacheKeeper:
    """Caps mlx's cache (``start``) and empties it when the stage holds nothing (``idle``)."""

    def __init__(
        self, limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES, idle_after_s: float = 2.0
    ) -> None:
        self.limit_bytes = limit_bytes
        #: how long the stage stays idle before its cache goes back, seconds
        self.idle_after_s = idle_after_s
        #: times the cache was given back on going idle
        self.cleared = 0
        #: whether ``start`` bounded the C allocator (``bound_malloc``)
        self.malloc_bounded = False

    def start(self) -> None:
        """Cap the cache and bound the C allocator (process-wide: one stage per process)."""
        mx.set_cache_limit(self.limit_bytes)
        self.malloc_bounded = bound_malloc()

    def idle(self) -> None:
        """Give the cache back: on the mlx thread, after the stage's last sequence went."""
        if mx.get_cache_memory() > 0:
            mx.clear_cache()
            self.cleared += 1
