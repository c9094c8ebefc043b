"""Surviving the loss of a stage: how the coordinator finds a new pipeline under its requests.

When a stage link closes, or stays silent past the heartbeat timeout, the coordinator keeps its
in-flight sequences (their prompts and the tokens already sent) and runs one ``Recovery``:

1. the lost node itself, again, for ``reconnect_grace_s`` (a restarted process, a healed link);
2. idle standby nodes (``role = "standby"``), one per lost stage, each loading only its layers;
3. the survivors (with what idle standbys there are), when the partitioner over their memory
   budgets fits the model on them: each loads only the layers it gains;
4. otherwise the requests fail naming the lost stage, and the original nodes are tried again
   every ``retry_every_s`` until the stage is back.

A stage lost while a recovery runs (a survivor that does not answer, or whose link fails while
layers load) restarts it from the survivors left, pass after pass (``core/recovery_passes.py``).
The same machinery puts the cluster file's layout back once the nodes a failover left out
serve again (``Recovery.restore``, driven by ``layout_restore.py``).

Every stage link is dropped first, so every stage frees the KV of every sequence; after the new
pipeline is up, each sequence is admitted again with its prompt plus the tokens it had produced
as its prefill, and goes on from the next token (``SequenceRunner._replayed``). Sampling draws
are a function of (seed, position) (``engine/sampling.py``), so a replayed sequence draws what
it would have. The coordinator itself is not replicated: see docs/failover.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from mlxppd.core.config.cluster import Node
from mlxppd.core.cpu_weights import float32_config
from mlxppd.core.errors import ConfigurationError, MlxppError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.partition.plan import balance_layers
from mlxppd.core.profile.model import ModelConfig, profile_from_config
from mlxppd.core.protocol.control import StageReport, Status
from mlxppd.core.recovery_passes import RecoveryPass, describe_stages
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
    restore_layout: bool = True
    """put the cluster file's layout back once the nodes a failover left out serve again"""
    restore_after_s: float = 30.0
    """how long those nodes must keep answering first, seconds"""
    restore_drain_s: float = 30.0
    """how long running requests may take to finish then (the rest are replayed), seconds"""

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
            restore_layout=policy.restore_layout,
            restore_after_s=policy.restore_after_s,
            restore_drain_s=policy.restore_drain_s,
        )


@dataclass(frozen=True)
class FailoverEvent:
    """One lost stage and what became of it (status, metrics, logs)."""

    lost_stage: int
    """the stage lost first (the detail names any lost while the recovery ran)"""
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


class _LostMore(Exception):
    """Stages of the pipeline were lost while a pass ran: the next pass builds without them."""

    def __init__(self, stages: Iterable[int]) -> None:
        self.stages = sorted(set(stages))
        super().__init__(f"stages {self.stages} were lost")


#: why a recovery that found nothing failed, for the health check and the log
NO_PATH = (
    "the node did not come back, no standby took its layers and the surviving stages lack the "
    "memory for them"
)


class Recovery:
    """The paths after a loss, in the order an operator would want; the first that works. A
    stage lost while they run starts them again on the survivors left."""

    def __init__(
        self, build: ChainBuilder, settings: FailoverSettings, nodes: list[Node],
        plan: tuple[LayerRange, ...] | None, lost: Iterable[int], standby: list[Node],
        file_plan: tuple[LayerRange, ...] | None, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.build = build
        self.settings = settings
        #: the pipeline the recovery started from, in stage order, and the plan it held
        self.nodes = list(nodes)
        self.plan = plan
        self._index = {node.id: i for i, node in enumerate(self.nodes)}
        # A standby serving in this pipeline is one of its stages, not a spare.
        self.standby = [node for node in standby if node.id not in self._index]
        #: the plan of the cluster file, which a restarted stage holds again
        self.file_plan = file_plan
        self._clock = clock
        self.passes = RecoveryPass.first(
            list(self._index), lost, clock(), settings.reconnect_grace_s
        )
        self._opened: list[StageLink] = []

    @classmethod
    def after_loss(
        cls, build: ChainBuilder, settings: FailoverSettings, chain: StageChain, index: int,
        standby: list[Node], file_plan: tuple[LayerRange, ...] | None,
    ) -> Recovery:  # fmt: skip
        """After stage ``index`` of ``chain`` (the serving pipeline) was lost."""
        return cls(build, settings, chain.nodes(), chain.plan, [index], standby, file_plan)

    async def attempt(
        self, reason: str, sequences: int
    ) -> tuple[FailoverEvent, NewPipeline | None]:
        """Run the passes within ``recovery_timeout_s``; the event to record, and the new
        pipeline, configured (None: the requests fail)."""
        started, at = self._clock(), time.time()
        first = min(self.passes.lost)
        new = await self._bounded()
        detail = new.detail if new is not None else NO_PATH
        if new is None and len(self.passes.survivors) == 0:
            detail = "no stage of the pipeline survived and no lost node came back"
        if len(self.passes.lost) > 1:
            detail = f"{self.passes.describe_lost()} were lost; {detail}"
        event = FailoverEvent(first, self.nodes[first].id, reason,
                              new.outcome if new else "failed", detail,
                              self._clock() - started, sequences, at)  # fmt: skip
        log.warning("failover: %s after %.1f s: %s; %d sequences %s", event.outcome,
                    event.seconds, detail, sequences, "replayed" if new else "failed")  # fmt: skip
        return event, new

    async def restore(self, sequences: int, back: Recovery) -> NewPipeline | None:
        """The cluster file's layout again: this recovery's nodes and plan are the file's, and
        none is lost. Its nodes move back to the file's layers; one that is away after all is
        recovered from as from any loss (a standby, the survivors). When nothing works,
        ``back`` (the layout that served) rebuilds the pipeline it had."""
        started = self._clock()
        new = await self._bounded()
        took = self._clock() - started
        if new is None:
            log.error("failover: the cluster file's layout could not be restored after %.1f s",
                      took)  # fmt: skip
            new = await back.rebuild()
            if new is not None:
                log.warning("failover: the layout that served before the restore serves again; "
                            "%d sequences replayed", sequences)  # fmt: skip
        elif new.outcome == "reconnected":
            log.warning(
                "failover: restored the cluster file's layout after %.1f s: %s hold %s; %d "
                "sequences replayed", took, ", ".join(n.id for n in new.chain.nodes()),
                _ranges(new.chain.plan or ()), sequences,
            )  # fmt: skip
        else:
            log.warning("failover: the cluster file's layout could not come back (%s lost); "
                        "%s after %.1f s: %s; %d sequences replayed", self.passes.describe_lost(),
                        new.outcome, took, new.detail, sequences)  # fmt: skip
        return new

    async def until_back(self) -> StageChain:
        """After a failed recovery: the original nodes, every few seconds, until they are
        back; their chain, configured."""
        while True:
            await asyncio.sleep(self.settings.retry_every_s)
            self._opened = []
            links = await self._reconnect(self.nodes, self._clock())
            if links is None:
                continue
            try:
                new = await self._realign(links)
                await self.build.configure(new.chain)
            except (MlxppError, OSError, _LostMore) as exc:
                log.info("failover: the stages are back but not ready yet: %s", exc)
                await drop_links(links)
                continue
            log.warning("failover: the lost stage is back; serving again")
            return new.chain

    async def rebuild(self) -> NewPipeline | None:
        """This recovery's pipeline again, from its own nodes and plan, none lost (a restore
        that failed goes back to the layout that served)."""
        return await self._bounded()

    async def _bounded(self) -> NewPipeline | None:
        try:
            async with asyncio.timeout(self.settings.recovery_timeout_s):
                return await self.run()
        except (TimeoutError, MlxppError, OSError) as exc:
            log.error("failover: the recovery failed: %s", exc or "timed out")
            return None

    async def run(self) -> NewPipeline | None:
        """Pass after pass until one builds a pipeline and it is configured; None when no
        path worked (the caller fails the requests)."""
        while True:
            self._opened = []
            built: NewPipeline | None = None
            try:
                new = await self._pass()
                if new is not None:
                    await self._configure(new.chain)
                built = new
                return new
            except _LostMore as more:
                lost = describe_stages(self.passes.nodes, more.stages)
                after = self.passes.lose(more.stages, self._clock())
                if after is None:
                    log.error("failover: %s lost too while recovering; no stage survives", lost)
                    self.passes = replace(self.passes, lost=frozenset(range(len(self.nodes))))
                    return None
                log.warning("failover: %s lost too while recovering; pass %d builds on %s",
                            lost, after.number,
                            ", ".join(after.nodes[i] for i in after.survivors))  # fmt: skip
                self.passes = after
            finally:
                kept = built.chain.links if built is not None else []
                await drop_links([link for link in self._opened if link not in kept])

    async def _pass(self) -> NewPipeline | None:
        """One pass: every node again for the grace, else idle standbys in the lost places,
        else the survivors (and what standbys there are) sharing the layers."""
        p = self.passes
        if (links := await self._reconnect(self.nodes, p.grace_ends)) is not None:
            return await self._realign(links)
        survivors, away = await self._reach([self.nodes[i] for i in p.survivors])
        if away:
            raise _LostMore(away)
        if not p.lost:  # every node answers after all (a restore): nothing to stand in for
            return await self._realign(survivors)
        standbys = await self._idle_standbys(len(p.lost))
        stages = p.adopted(len(standbys))
        if stages is not None:
            adopted = await self._adopt(survivors, standbys, stages)
            if adopted is not None:
                return adopted
            standbys = [link for link in standbys if link.alive]
        return await self._spread(survivors, standbys)

    async def _open(self, node: Node) -> StageLink:
        """A link for this pass (dropped when the pass ends, unless its pipeline serves)."""
        link = await self.build.open_link(node)
        self._opened.append(link)
        return link

    async def _configure(self, chain: StageChain) -> None:
        try:
            await self.build.configure(chain)
        except BackendUnavailable:
            self._raise_if_lost(chain.links)
            raise

    def _raise_if_lost(self, links: list[StageLink]) -> None:
        """A stage of the pipeline whose link failed under this pass: restart without it."""
        dead = [self._index[link.node.id] for link in links
                if not link.alive and link.node.id in self._index]  # fmt: skip
        if dead:
            raise _LostMore(dead)

    async def _realign(self, links: list[StageLink]) -> NewPipeline:
        """Every node is back. A restarted stage holds the cluster file's layers: when the
        plan in force was another (an elastic repartition), every stage returns to the file's,
        as a reconnecting coordinator does (``Coordinator.align_stages``); a pipeline of
        another length than the file's returns to the plan in force."""
        chain = self.build.chain(links, self.plan)
        try:
            held = [r.layers for r in await chain.status()]
        except BackendUnavailable:
            self._raise_if_lost(links)
            raise
        if self.plan is not None and held != [r.pair for r in self.plan]:
            plan = self.file_plan
            if plan is None or len(plan) != len(links):
                plan = self.plan  # a failover's layout served: back to it
            if not await self._move(chain, plan, list(range(len(links)))):
                self._raise_if_lost(links)
                raise MlxppError("the stages could not return to the planned layers")
            log.info("failover: moved the stages back to the planned layers")
        return NewPipeline(chain, "reconnected", "the lost node came back")

    async def _reconnect(self, nodes: list[Node], until: float) -> list[StageLink] | None:
        """Links to every node of ``nodes``, trying until ``until`` (on the recovery's clock);
        None if one stays away."""
        while True:
            links: list[StageLink] = []
            try:
                for node in nodes:
                    links.append(await self._open(node))
                return links
            except (MlxppError, OSError) as exc:
                await drop_links(links)
                if self._clock() >= until:
                    log.info("failover: %s", exc)
                    return None
                await asyncio.sleep(min(0.5, max(0.0, until - self._clock())))

    async def _reach(self, nodes: list[Node]) -> tuple[list[StageLink], list[int]]:
        """One try at each of ``nodes``: the links, and the stages that did not answer."""
        links: list[StageLink] = []
        away: list[int] = []
        for node in nodes:
            try:
                links.append(await self._open(node))
            except (MlxppError, OSError) as exc:
                log.warning("failover: stage node %s does not answer: %s", node.id, exc)
                away.append(self._index[node.id])
        return links, away

    async def _idle_standbys(self, wanted: int) -> list[StageLink]:
        """Links to up to ``wanted`` reachable standbys, in the file's order. One that holds
        layers from an earlier failover is free again: it is in no stage of this pipeline."""
        found: list[StageLink] = []
        for standby in self.standby:
            if len(found) >= wanted:
                break
            try:
                link = await self._open(standby)
                report = await self.build.chain([link], None).ask(link, Status(), StageReport)
            except (MlxppError, OSError) as exc:
                log.warning("failover: standby %s is not reachable: %s", standby.id, exc)
                continue
            if report.stage != -1:
                log.info("failover: standby %s still holds layers %d-%d from an earlier failover; "
                         "it serves no stage now", standby.id, report.layers[0],
                         report.layers[1] - 1)  # fmt: skip
            found.append(link)
        return found

    async def _adopt(
        self, survivors: list[StageLink], standbys: list[StageLink], stages: tuple[int, ...]
    ) -> NewPipeline | None:
        """One standby per lost stage takes its layers (of the plan in force)."""
        if self.plan is None:
            return None
        taking = standbys[: len(stages)]
        if not await self._move(self.build.chain(taking, None), self.plan, list(stages)):
            return None
        place = dict(zip(stages, taking, strict=True))
        rest = iter(survivors)
        links = [place[i] if i in place else next(rest) for i in range(len(self.nodes))]
        detail = "; ".join(
            f"standby {link.node.id} took layers {self.plan[i].start}-{self.plan[i].end - 1}"
            for i, link in place.items()
        )
        return NewPipeline(self.build.chain(links, self.plan), "standby", detail)

    async def _spread(
        self, survivors: list[StageLink], standbys: list[StageLink]
    ) -> NewPipeline | None:
        """The survivors (with a standby in each lost place there is one for) share every
        layer, when the partitioner says they fit."""
        if self.settings.replan is None or not survivors:
            return None
        place = dict(zip(self.passes.survivors, survivors, strict=True))
        spare = iter(standbys)
        links = [place[i] if i is not None else next(spare)
                 for i in self.passes.shared(len(standbys))]  # fmt: skip
        chain = self.build.chain(links, None)
        try:
            reports = await chain.status()
        except BackendUnavailable:
            self._raise_if_lost(links)
            raise
        target = self.settings.replan(reports)
        if target is None:
            log.warning("failover: the %d surviving stages lack the memory for the model",
                        len(links))  # fmt: skip
            return None
        if not await self._move(chain, target, list(range(len(links)))):
            self._raise_if_lost(links)
            return None
        joined = [link.node.id for link in links if link.node.id not in self._index]
        detail = f"{len(survivors)} survivors now hold {_ranges(target)}"
        if joined:
            detail = (f"{len(survivors)} survivors and standby {', '.join(joined)} now hold "
                      f"{_ranges(target)}")  # fmt: skip
        return NewPipeline(chain, "standby" if joined else "survivors", detail)

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


def _ranges(plan: Iterable[LayerRange]) -> str:
    """``0-9, 10-19``: a plan for a log line (last layers inclusive)."""
    return ", ".join(f"{r.start}-{r.end - 1}" for r in plan)
