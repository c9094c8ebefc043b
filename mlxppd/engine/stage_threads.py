"""How many BLAS threads a stage's pass uses when its host's cores are shared with other
stages (a local cluster).

Stages on one host split its cores (``runtime/local_cluster.py``): while several steps are in
the pipeline every stage computes at once, and threads beyond a stage's share would only fight
over cores. But with one stream decoding alone, one stage computes at a time and the others
wait: that pass may use every core (the coordinator marks it ``solo``). A single stream then
decodes as fast as one process that has every core, and many streams keep one core each.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from mlxppd.engine import blas

#: the environment variable a local cluster sets: the threads a solo pass may use
SOLO_ENV = "MLXPP_SOLO_THREADS"
_SHARE_ENV = "OPENBLAS_NUM_THREADS"


class StageThreads:
    """Switches the BLAS between its share of the cores and the solo count, on the mlx thread
    right before each pass (the count is global to the process)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.share = _positive(env.get(_SHARE_ENV))
        self.solo = _positive(env.get(SOLO_ENV))
        self._current = self.share

    @property
    def enabled(self) -> bool:
        return self.share is not None and self.solo is not None and self.solo > self.share

    def before_pass(self, solo: bool) -> None:
        if not self.enabled:
            return
        wanted = self.solo if solo else self.share
        if wanted != self._current and wanted is not None and blas.set_threads(wanted):
            self._current = wanted


def _positive(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value >= 1 else None
