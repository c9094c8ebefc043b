"""Surviving the loss of a stage: how the coordinator finds a new pipeline under its requests.

When a stage link closes, or stays silent past the heartbeat timeout, the coordinator keeps its
in-flight sequences (their prompts and the tokens already sent) and runs one ``Recovery``:

1. the lost node itself, again, for ``reconnect_grace_s`` (a restarted process, a healed link);
2. a standby node (``role = "standby"``), which loads only the lost stage's layers;
3. the survivors, when the partitioner over their memory budgets fits the model on them: each
   loads only the layers it gains (the elastic path, with stage indices shifting down);
4. otherwise the requests fail naming the lost stage, and the original nodes are tried again
   every ``retry_every_s`` until the stage is back.

Every stage link is dropped first, so every stage frees the KV of every sequence; after the new
pipeline is up, each sequence is admitted again with its prompt plus the tokens it had produced
as its prefill, and goes on from the next token (``Coordinator._replayed``). Sampling draws are a
function of (seed, position) (``engine/sampling.py``), so a replayed sequence draws what it
would have. The coordinator itself is not replicated: see docs/failover.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mlxppd.core.config.cluster import Node
from mlxppd.core.cpu_weights import float32_config
from mlxppd.core.errors import ConfigurationError, MlxppError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.partition.plan import balance_layers
from mlxppd.core.profile.model import ModelConfig, profile_from_config
from mlxppd.core.protocol.control import StageReport, Status
from mlxppd.runtime.backends.contract import BackendUnavailable
from mlxppd.runtime.coordinator.chain import LayerMoveError, LinkLost, StageChain, drop_links
from mlxppd.runtime.coordinator.stage_link import StageLink


@dataclass(frozen=True)
class ChainBuilder:
    """How the coordinator builds a pipeline: a recovery's trial chains are built the same way
    as the serving one, with its error policy, and configured the same way."""

    open_link: Callable[[Node], Awaitable[StageLink]]
    """a link to the node with its reader running (one try)"""
    on_lost: LinkLost
    configure: Callable[[StageChain], Awaitable[None]]
    """check what every stage serves, then tell each its place in the chain"""

    def chain(self, links: list[StageLink], plan: tuple[LayerRange, ...] | None) -> StageChain:
        return StageChain(links, plan, self.on_lost)


log = logging.getLogger("mlxppd.failover")

#: how a recovery ended; the label of ``mlxpp_pp_failovers_total``
OUTCOMES = ("reconnected", "standby", "survivors", "failed")
#: a new plan for the survivors from their reports, or None when the model does not fit them
Replan = Callable[[list[StageReport]], tuple[LayerRange, ...] | None]


def survivors_replan(config: ModelConfig) -> Replan:
    """The partitioner over the survivors' memory budgets, priced at the weights they hold."""
    native = profile_from_config(config)
    float32 = profile_from_config(float32_config(config))

    def replan(reports: list[StageReport]) -> tuple[LayerRange, ...] | None:
        profile = float32 if any(r.weights == "float32" for r in reports) else native
        try:
            plan = balance_layers(profile, len(reports), [r.memory_budget_bytes for r in reports])
        except ConfigurationError as exc:
            log.warning("failover: %s", exc)
            return None
        return tuple(plan.ranges)

    return replan


class PipelineInterrupted(BackendUnavailable):
    """A stage was lost under this sequence; it is replayed once the pipeline recovers.

    A ``BackendUnavailable``: whoever only asks the stages something (status, metrics polls)
    treats it as the pipeline being away for now."""


@dataclass(frozen=True)
class FailoverSettings:
    """The coordinator's side of ``[cluster.failover]``, plus how to replan for survivors."""

    heartbeat_interval_s: float = 1.0
    """how often each side of a stage link says it is alive, seconds"""
    heartbeat_timeout_s: float = 5.0
    """silence after which a link counts as lost, seconds"""
    reconnect_grace_s: float = 10.0
    """how long the lost node itself is tried before a standby or the survivors, seconds"""
    recovery_timeout_s: float = 600.0
    """the whole recovery, loading layers included, seconds"""
    retry_every_s: float = 2.0
    """after a failed recovery, how often the original nodes are tried again, seconds"""
    replan: Replan | None = None
    """None: the lost layers are never spread over the survivors"""

    @classmethod
    def from_policy(cls, policy: Any, replan: Replan | None) -> FailoverSettings | None:
        """From the TOML's ``[cluster.failover]`` (None when it is disabled)."""
        if policy is None or not getattr(policy, "enabled", True):
            return None
        return cls(
            heartbeat_interval_s=policy.heartbeat_interval_s,
            heartbeat_timeout_s=policy.heartbeat_timeout_s,
            reconnect_grace_s=policy.reconnect_grace_s,
            recovery_timeout_s=policy.recovery_timeout_s,
            replan=replan,
        )


@dataclass(frozen=True)
class FailoverEvent:
    """One lost stage and what became of it (status, metrics, logs)."""

    lost_stage: int
    lost_node: str
    reason: str
    outcome: str
    """one of OUTCOMES"""
    detail: str
    seconds: float
    """from the loss to the new pipeline (or to giving up)"""
    sequences: int
    """in-flight sequences at the loss (each replayed when it recovered)"""
    at: float
    """wall clock of the loss, seconds"""


@dataclass(frozen=True)
class NewPipeline:
    chain: StageChain
    outcome: str
    """one of OUTCOMES"""
    detail: str


class Recovery:
    """The paths after one loss, in the order an operator would want; the first that works."""

    def __init__(
        self, build: ChainBuilder, settings: FailoverSettings, lost: StageChain, index: int,
        standby: list[Node], file_plan: tuple[LayerRange, ...] | None,
    ) -> None:  # fmt: skip
        self.build = build
        self.settings = settings
        self.lost = index
        self.nodes = lost.nodes()
        self.plan = lost.plan
        self.standby = standby
        #: the plan of the cluster file, which a restarted stage holds again
        self.file_plan = file_plan

    async def attempt(
        self, reason: str, sequences: int
    ) -> tuple[FailoverEvent, NewPipeline | None]:
        """Run the paths within ``recovery_timeout_s`` and configure the new chain; the event
        to record, and the new pipeline (None: the requests fail)."""
        started, at = time.monotonic(), time.time()
        node = self.nodes[self.lost]
        new: NewPipeline | None = None
        try:
            async with asyncio.timeout(self.settings.recovery_timeout_s):
                new = await self.run()
                if new is not None:
                    await self.build.configure(new.chain)
        except (TimeoutError, MlxppError, OSError) as exc:
            log.error("failover: the recovery failed: %s", exc or "timed out")
            if new is not None:
                await new.chain.close()
            new = None
        detail = new.detail if new is not None else (
            "the node did not come back, no standby took its layers and the surviving stages "
            "lack the memory for them"
        )  # fmt: skip
        event = FailoverEvent(self.lost, node.id, reason, new.outcome if new else "failed",
                              detail, time.monotonic() - started, sequences, at)  # fmt: skip
        log.warning("failover: %s after %.1f s: %s; %d sequences %s", event.outcome,
                    event.seconds, detail, sequences, "replayed" if new else "failed")  # fmt: skip
        return event, new

    async def until_back(self) -> StageChain:
        """After a failed recovery: the original nodes, every few seconds, until they are
        back; their chain, configured."""
        while True:
            await asyncio.sleep(self.settings.retry_every_s)
            links = await self._reconnect(self.nodes, time.monotonic())
            if links is None:
                continue
            try:
                new = await self._realign(links)
                await self.build.configure(new.chain)
            except (MlxppError, OSError) as exc:
                log.info("failover: the stages are back but not ready yet: %s", exc)
                await drop_links(links)
                continue
            log.warning("failover: the lost stage is back; serving again")
            return new.chain

    async def run(self) -> NewPipeline | None:
        """The new pipeline, or None when no path worked (the caller fails the requests)."""
        deadline = time.monotonic() + self.settings.reconnect_grace_s
        if (links := await self._reconnect(self.nodes, deadline)) is not None:
            return await self._realign(links)
        survivors = [n for i, n in enumerate(self.nodes) if i != self.lost]
        links = await self._reconnect(survivors, time.monotonic())
        if links is None:
            return None  # more than one stage is gone: nothing to build on
        for standby in self.standby:
            adopted = await self._adopt(standby, links)
            if adopted is not None:
                return adopted
        spread = await self._spread(links)
        if spread is not None:
            return spread
        await drop_links(links)
        return None

    async def _realign(self, links: list[StageLink]) -> NewPipeline:
        """The lost node is back. A restarted stage holds the cluster file's layers: when the
        plan in force was another (an elastic repartition), every stage returns to the file's,
        as a reconnecting coordinator does (``Coordinator.align_stages``)."""
        chain = self.build.chain(links, self.plan)
        held = [r.layers for r in await chain.status()]
        if self.plan is not None and held != [r.pair for r in self.plan]:
            plan = self.file_plan
            if plan is None or len(plan) != len(links):
                raise MlxppError("the stages hold other layers than the plan, and none fits")
            if not await self._move(chain, plan, list(range(len(links)))):
                raise MlxppError("the stages could not return to the cluster file's layers")
            log.info("failover: moved the stages back to the planned layers")
        return NewPipeline(chain, "reconnected", "the lost node came back")

    async def _reconnect(self, nodes: list[Node], deadline: float) -> list[StageLink] | None:
        """Links to every node of ``nodes``, trying until ``deadline``; None if one stays away."""
        while True:
            links: list[StageLink] = []
            try:
                for node in nodes:
                    links.append(await self.build.open_link(node))
                return links
            except (MlxppError, OSError) as exc:
                await drop_links(links)
                if time.monotonic() >= deadline:
                    log.info("failover: %s", exc)
                    return None
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def _adopt(self, standby: Node, survivors: list[StageLink]) -> NewPipeline | None:
        """``standby`` takes the lost stage's layers (of the current plan)."""
        if self.plan is None:
            return None
        try:
            link = await self.build.open_link(standby)
        except (MlxppError, OSError) as exc:
            log.warning("failover: standby %s is not reachable: %s", standby.id, exc)
            return None
        alone = self.build.chain([link], None)
        report = await alone.ask(link, Status(), StageReport)
        if report.stage != -1:
            log.warning("failover: %s is not an idle standby (it serves stage %d)", standby.id,
                        report.stage)  # fmt: skip
            await alone.close()
            return None
        if not await self._move(alone, self.plan, [self.lost]):
            await alone.close()
            return None
        links = [*survivors[: self.lost], link, *survivors[self.lost :]]
        held = self.plan[self.lost]
        detail = f"standby {standby.id} took layers {held.start}-{held.end - 1}"
        return NewPipeline(self.build.chain(links, self.plan), "standby", detail)

    async def _spread(self, survivors: list[StageLink]) -> NewPipeline | None:
        """The survivors share the lost layers, when the partitioner says they fit."""
        if self.settings.replan is None or not survivors:
            return None
        chain = self.build.chain(survivors, None)
        target = self.settings.replan(await chain.status())
        if target is None:
            log.warning("failover: the %d surviving stages lack the memory for the model",
                        len(survivors))  # fmt: skip
            return None
        if not await self._move(chain, target, list(range(len(survivors)))):
            return None
        detail = f"{len(survivors)} survivors now hold " + ", ".join(
            f"{r.start}-{r.end - 1}" for r in target
        )
        return NewPipeline(chain, "survivors", detail)

    async def _move(
        self, chain: StageChain, plan: tuple[LayerRange, ...], stages: list[int]
    ) -> bool:
        """The chain's two-phase move to ``plan`` (its link i becomes stage ``stages[i]``)."""
        try:
            prepared = await chain.move(plan, self.settings.recovery_timeout_s, stages)
        except LayerMoveError as exc:
            log.warning("failover: the new layers could not be loaded: %s", exc)
            return False
        except BackendUnavailable as exc:
            log.warning("failover: a stage was lost while loading the new layers: %s", exc)
            return False
        for link, reply in zip(chain.links, prepared, strict=True):
            load = reply.load()
            if load is not None:
                log.info("failover: %s loaded layers %d-%d (%d tensors read, %d kept) in %.1f s",
                         link.node.id, load.layers[0], load.layers[1] - 1, load.loaded_tensors,
                         load.reused_tensors, load.load_s)  # fmt: skip
        return True
