"""An agent's tensor-parallel rank above 0: it serves no transport, it follows its rank 0.

It runs on an mlx thread of its own: a follower waits in the ring for rank 0's next call and
nothing but rank 0 (or the ring breaking) ends that wait, so stopping it means leaving the
thread behind (a daemon, ended by the ring's own error once rank 0's side closes) and starting
the next one on a fresh thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from mlxppd.runtime.node_start import StageSetup, run_tensor_follower
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.tasks import spawn

__all__ = ["FollowerRun"]

log = logging.getLogger("mlxppd.agent")


class FollowerRun:
    def __init__(self, setup: StageSetup) -> None:
        rank = setup.tensor.rank if setup.tensor is not None else 0
        self.mlx = MlxThread(f"mlx-stage{setup.spec.index}-rank{rank}")
        #: its shard is loaded and it follows rank 0 (the agent is ready)
        self.following = False
        self.task = spawn(
            run_tensor_follower(setup, self.mlx, on_following=self._joined), name="tp-follower"
        )

    def _joined(self) -> None:
        self.following = True

    @property
    def running(self) -> bool:
        """Joining or following (False once rank 0 stopped or the ring broke)."""
        return not self.task.done()

    async def stop(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for rank 0 to end the following, then leave it behind."""
        with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(self.task), wait_s)
        if not self.task.done():
            log.warning("tensor-parallel follower still waits on rank 0; leaving it behind")
            self.task.cancel()
        self.mlx.close(timeout=0.5)
