"""The process's limit on open files: raised to what the system allows, once, at stage start.

Every connection to a stage port costs a file descriptor until the listener has looked at it
(it closes those beyond its handshake caps at once). A soft limit well below the hard one
(often 1024 against 524288 on Linux) only makes an out-of-descriptors state easier to reach,
so a stage raises its soft limit to the hard one; nothing else depends on the lower number.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["raise_open_file_limit"]

log = logging.getLogger(__name__)

# macOS refuses a soft limit above OPEN_MAX (10240) even when the hard limit is unlimited.
_DARWIN_OPEN_MAX = 10240


def raise_open_file_limit() -> int | None:
    """Set the soft RLIMIT_NOFILE to the hard limit; the soft limit now (None: unknown)."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if sys.platform == "darwin" and (hard == resource.RLIM_INFINITY or hard > _DARWIN_OPEN_MAX):
        target = _DARWIN_OPEN_MAX
    if soft == resource.RLIM_INFINITY or (target != resource.RLIM_INFINITY and soft >= target):
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:  # a sandbox may forbid it: keep what we have
        log.info("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
        return soft
    log.debug("open-file limit raised from %d to %d", soft, target)
    return target
