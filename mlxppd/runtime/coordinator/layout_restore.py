"""Watching for the nodes a failover left out, and having the coordinator take them back.

After a standby or the survivors took a lost stage's layers (``recovery.py``), the pipeline
runs on other nodes than the cluster file names. Every ``retry_every_s`` this part asks each
node of the file's pipeline that the serving one lacks for its status; once all of them have
kept answering for ``restore_after_s`` and nothing holds admissions (``core/layout_restore.py``
decides), it has the coordinator put the file's layout back (``Coordinator.restore_layout``:
new requests wait, running ones drain or are replayed, ``StageChain.move`` moves the layers).
A node is asked on a link of its own, never one of the serving pipeline's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from mlxppd.core.config.cluster import Node
from mlxppd.core.errors import MlxppError
from mlxppd.core.layout_restore import RestoreWatch, drain_over, missing_nodes
from mlxppd.core.protocol.control import StageReport, Status
from mlxppd.runtime.coordinator.recovery import ChainBuilder, FailoverSettings

__all__ = ["LayoutRestorer", "drained"]

log = logging.getLogger("mlxppd.failover")
#: how often a restore's drain looks whether the running requests are done, seconds
DRAIN_POLL_S = 0.05


async def drained(
    active: Callable[[], int], restoring: Callable[[], bool], clock: Callable[[], float],
    drain_s: float,
) -> bool:  # fmt: skip
    """Wait until nothing runs or ``drain_s`` passed (``core/layout_restore.py``); False when
    the restore was called off meanwhile (a stage lost: a failover took over)."""
    started = clock()
    while not drain_over(active(), started, clock(), drain_s):
        await asyncio.sleep(DRAIN_POLL_S)
        if not restoring():
            return False
    return restoring()


class LayoutRestorer:
    """The coordinator's watch for its file's layout (``run`` is its task)."""

    def __init__(
        self,
        settings: FailoverSettings,
        build: ChainBuilder,
        *,
        file_nodes: Callable[[], list[Node]],
        serving_nodes: Callable[[], list[Node]],
        serving: Callable[[], bool],
        held: Callable[[], bool],
        restore: Callable[[], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._build = build
        #: the cluster file's pipeline nodes, in stage order
        self._file_nodes = file_nodes
        #: the nodes of the pipeline serving now, in stage order
        self._serving_nodes = serving_nodes
        #: the coordinator serves (not recovering, restoring, down)
        self._serving = serving
        #: something holds admissions (an operator's drain, a repartition, a reload)
        self._held = held
        self._restore = restore
        self._clock = clock
        self.watch = RestoreWatch(settings.restore_after_s)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.retry_every_s)
            await self.look()

    async def look(self) -> bool:
        """One look at the missing nodes; True when it restored the file's layout."""
        file_nodes = self._file_nodes()
        serving = [n.id for n in self._serving_nodes()]
        missing = missing_nodes(serving, [n.id for n in file_nodes]) if self._serving() else ()
        answered = False
        if missing:
            asked = [await self.answers(n) for n in file_nodes if n.id in missing]
            answered = all(asked)
        before = self.watch
        self.watch = self.watch.observe(missing, answered, self._clock())
        if self.watch.answering_since is not None and before.answering_since is None:
            log.info("failover: %s answer again; the cluster file's layout comes back once they "
                     "have for %g s with no admissions held", ", ".join(missing),
                     self.watch.wait_s)  # fmt: skip
        if not self.watch.due(self._clock(), self._held()) or not self._serving():
            return False
        log.warning("failover: %s answered for %g s; restoring the cluster file's layout",
                    ", ".join(missing), self.watch.wait_s)  # fmt: skip
        await self._restore()
        now_serving = [n.id for n in self._serving_nodes()]
        if missing_nodes(now_serving, [n.id for n in self._file_nodes()]):
            self.watch = self.watch.failed()
            log.warning("failover: the cluster file's layout did not come back; the next try "
                        "waits for %g s of answers", self.watch.wait_s)  # fmt: skip
            return False
        self.watch = RestoreWatch(self._settings.restore_after_s)
        return True

    async def answers(self, node: Node) -> bool:
        """Whether ``node``, in no stage of the serving pipeline, answers a status request now
        (on a link of its own, dropped after)."""
        try:
            link = await self._build.open_link(node)
        except (MlxppError, OSError):
            return False
        chain = self._build.chain([link], None)
        try:
            await chain.ask(link, Status(), StageReport, self._settings.heartbeat_timeout_s)
            return True
        except (MlxppError, OSError):
            return False
        finally:
            await chain.close()
