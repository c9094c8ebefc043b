"""Which event loop a mlxppd process runs on: uvloop where it is installed, else asyncio's.

Every wire message crosses the loop twice (a readiness callback, then the waiting task), so
the loop's own cost is part of each decode step's latency: uvloop (libuv, in C) takes about
2-3 µs off a secure 8 KiB hand-off here (``bench/transport.py``). mlxppd only uses what both
loops offer, so ``MLXPP_EVENT_LOOP=asyncio`` switches back to the standard loop, e.g. to rule
the loop out while hunting a bug.
"""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from mlxppd.core.errors import ConfigurationError

__all__ = ["EVENT_LOOP_ENV", "LOOP_CHOICES", "event_loop_factory", "run"]

T = TypeVar("T")

#: Environment variable choosing the loop: auto (default), uvloop or asyncio.
EVENT_LOOP_ENV = "MLXPP_EVENT_LOOP"
LOOP_CHOICES = ("auto", "uvloop", "asyncio")


def event_loop_factory(
    environ: Mapping[str, str] | None = None,
) -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The loop's name and a factory for it, as ``MLXPP_EVENT_LOOP`` (in ``environ``) asks."""
    env = os.environ if environ is None else environ
    choice = env.get(EVENT_LOOP_ENV, "auto").strip().lower() or "auto"
    if choice not in LOOP_CHOICES:
        raise ConfigurationError(
            f"{choice!r} is not one of {', '.join(LOOP_CHOICES)}; "
            "unset it to use uvloop where it is installed",
            source=EVENT_LOOP_ENV,
        )
    if choice != "asyncio":
        try:
            uvloop = importlib.import_module("uvloop")
        except ImportError:
            if choice == "uvloop":
                raise ConfigurationError(
                    "uvloop is asked for but not installed; pip install uvloop, or unset it",
                    source=EVENT_LOOP_ENV,
                ) from None
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], *, environ: Mapping[str, str] | None = None) -> T:
    """``asyncio.run(main)`` on the loop ``event_loop_factory`` picks."""
    try:
        _, factory = event_loop_factory(environ)
    except BaseException:
        main.close()  # never awaited: say so quietly instead of a RuntimeWarning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
