"""``mlxppctl prepare`` on the coordinator: ship every stage node what its layers need.

The coordinator's host holds the cluster's copy. For each stage node of the file's plan, the
job opens a channel to the node's stage port (the same authenticated, encrypted transport as
the pipeline), and ``runtime/coordinator/model_sender.py`` does the rest; nodes are prepared at
once, each with its own progress. The agent starts the same job by itself at start for nodes
that hold no copy at all (``[cluster] auto_prepare``); a node whose copy differs is only
replaced when an operator asks, since its files might be the ones that are right.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from mlxppd.core.config.cluster import Node
from mlxppd.core.stages import StageSpec
from mlxppd.core.status_document import PrepareNodeProgress, PrepareStatus
from mlxppd.runtime.coordinator.model_sender import (
    ShipProgress,
    files_for,
    manifest_for,
    ship_stage,
)
from mlxppd.wire.tasks import spawn, stop_tasks
from mlxppd.wire.transport import Transport

log = logging.getLogger("mlxppd.prepare")


class PrepareJob:
    """One prepare of some stage nodes, from the copy in ``source``."""

    def __init__(
        self,
        targets: Sequence[tuple[Node, StageSpec]],
        source: Path,
        config: dict[str, Any],
        transport: Transport,
        *,
        cache_dir: Path | None = None,
        max_rate_bytes_s: float | None = None,
        reason: str = "operator",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.targets = list(targets)
        self.source = source
        self.config = config
        self.transport = transport
        self.cache_dir = cache_dir
        self.max_rate_bytes_s = max_rate_bytes_s
        self.reason = reason
        self.started_at = time.time()
        self.state: Literal["running", "done", "failed"] = "running"
        self.progress = [
            ShipProgress(node.id, spec.index, (spec.start, spec.end), clock=clock)
            for node, spec in self.targets
        ]

    async def run(self) -> bool:
        """Prepare every target at once; True when all ended with the cluster's copy."""
        pairs = zip(self.targets, self.progress, strict=True)
        results = await asyncio.gather(*(self._one(n, spec, p) for (n, spec), p in pairs))
        self.state = "done" if all(results) else "failed"
        return all(results)

    async def _one(self, node: Node, spec: StageSpec, progress: ShipProgress) -> bool:
        try:
            manifest, tensors = await asyncio.to_thread(
                manifest_for, self.source, spec, self.config, self.source.name, self.cache_dir
            )
            result = await ship_stage(
                self.transport,
                node,
                manifest,
                tensors,
                progress,
                files=files_for(self.source, manifest),
                max_rate_bytes_s=self.max_rate_bytes_s,
            )
        except Exception as exc:  # one node's failure is reported; the others go on
            progress.state, progress.error = "failed", str(exc)[:600] or type(exc).__name__
            log.error("prepare: %s: %s", node.id, progress.error)
            return False
        if result is None:
            log.info("prepare: %s already holds layers %d-%d", node.id, spec.start, spec.end - 1)
        else:
            log.info(
                "prepare: %s now holds layers %d-%d (%s): %.1f MB sent, %.1f MB resumed",
                node.id, spec.start, spec.end - 1, progress.found,
                progress.bytes_sent / 1e6, progress.bytes_resumed / 1e6,
            )  # fmt: skip
        return True

    def status(self) -> PrepareStatus:
        """The job as the status document shows it (``coordinator.prepare``)."""
        return PrepareStatus(
            state=self.state,
            reason=self.reason,
            started_at=self.started_at,
            max_rate_bytes_s=self.max_rate_bytes_s,
            nodes=tuple(_node_progress(p) for p in self.progress),
        )


def _node_progress(progress: ShipProgress) -> PrepareNodeProgress:
    """One node's progress; rate and ETA to a tenth (of bytes per second, of seconds)."""
    eta = progress.eta_s()
    return PrepareNodeProgress(
        node=progress.node,
        stage=progress.stage,
        layers=progress.layers,
        state=progress.state,
        found=progress.found,
        tensors_needed=progress.tensors_needed,
        bytes_total=progress.bytes_total,
        bytes_resumed=progress.bytes_resumed,
        bytes_sent=progress.bytes_sent,
        stage_bytes=progress.stage_bytes,
        rate_bytes_s=round(progress.rate(), 1),
        eta_s=None if eta is None else round(eta, 1),
        error=progress.error,
    )


class Preparer:
    """The coordinator agent's prepares: at most one running; the last one shown in status."""

    def __init__(self, on_done: Callable[[], None] = lambda: None) -> None:
        self.job: PrepareJob | None = None
        self._task: asyncio.Task[None] | None = None
        self._on_done = on_done

    @property
    def running(self) -> bool:
        return self.job is not None and self.job.state == "running"

    def may_auto(self) -> bool:
        """Whether the agent may start a prepare by itself: none ran yet, or the last failed
        (a node that was just shipped its copy reports "missing" until its stage restarts)."""
        return self.job is None or self.job.state == "failed"

    def start(self, job: PrepareJob) -> dict[str, Any]:
        """Run ``job`` in the background; refused while another runs."""
        if self.running:
            return {
                "accepted": False,
                "reason": "running",
                "message": "a prepare is already running; watch it with mlxppctl status",
            }
        self.job = job
        self._task = spawn(self._run(job), name="prepare")
        nodes = [node.id for node, _ in job.targets]
        log.info("prepare (%s): shipping what they lack to %s", job.reason, ", ".join(nodes))
        return {"accepted": True, "nodes": nodes}

    async def _run(self, job: PrepareJob) -> None:
        await job.run()
        self._on_done()  # the coordinator connects again at once

    async def close(self) -> None:
        await stop_tasks(self._task)

    def status(self) -> PrepareStatus | None:
        return self.job.status() if self.job is not None else None
