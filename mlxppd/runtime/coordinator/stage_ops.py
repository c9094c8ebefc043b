"""What the coordinator does to every stage at once: coordinated KV admission, heartbeats,
status, the two-phase move to new layer ranges, traces.

A mixin of ``Coordinator`` (``coordinator.py``), which holds the links these talk over; kept
apart so each file holds one concern: serving sequences there, operating the stages here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np

from mlxppd.core.errors import TemporaryError
from mlxppd.core.kv_admission import AdmissionDiagnostic, RejectReason
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.model_identity import IdentityCheck
from mlxppd.core.prompt_cache import PromptIndex
from mlxppd.core.protocol.control import (
    Ack,
    Admission,
    Admit,
    AdmitReply,
    Forget,
    Heartbeat,
    Reassign,
    ReassignReply,
    Release,
    StageReport,
    Status,
)
from mlxppd.core.strict import StrictModel
from mlxppd.runtime.backends.contract import (
    AdmissionClosed,
    AdmissionRejected,
    BackendUnavailable,
    Health,
    RequestRefused,
    SamplingParams,
)
from mlxppd.runtime.coordinator.identity_check import (
    IdentityReference,
    ModelMismatch,
    check_links,
    refuse_mismatches,
)
from mlxppd.runtime.coordinator.stage_link import StageLink
from mlxppd.runtime.coordinator.stage_trace import stage_trace_events
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.trace import TraceBuffer, TraceFile
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import ChannelClosedError, FrameError
from mlxppd.wire.transport import Transport

ReplyT = TypeVar("ReplyT", bound=StrictModel)
log = logging.getLogger("mlxppd.coordinator")


class LayerMoveError(TemporaryError):
    """Moving the stages to new layer ranges failed; ``refusals`` is (stage, error) per stage
    that refused. After a refused prepare every stage keeps its old range; after a failed
    commit (``committed``) a stage is broken, not busy."""

    def __init__(self, message: str, refusals: list[tuple[int, str]], *, committed: bool):
        super().__init__(message)
        self.refusals = refusals
        self.committed = committed


class StageOps:
    """Operations on every stage of the pipeline (mixed into ``Coordinator``)."""

    plan: tuple[LayerRange, ...] | None
    transport: Transport
    metrics: PipelineMetrics | None
    trace: TraceBuffer
    _links: list[StageLink]
    _broken: str | None
    _trace_file: TraceFile | None
    failover: Any
    identity: IdentityReference | None
    identity_checks: list[IdentityCheck]
    prompts: PromptIndex | None
    _ready: bool
    _recovered: asyncio.Event
    _recovering: str

    if TYPE_CHECKING:  # provided by Coordinator: how a link's failure is handled

        def _fail(self, link: StageLink, reason: str) -> None: ...

        async def _request(
            self, link: StageLink, command: StrictModel, reply: type[ReplyT],
            timeout_s: float = ..., payload: Any = None,
        ) -> ReplyT: ...  # fmt: skip

        def _answering(self, link: StageLink) -> Any: ...

        async def ask(
            self, link: StageLink, command: StrictModel, reply: type[ReplyT],
            timeout_s: float = ...,
        ) -> ReplyT: ...  # fmt: skip

    async def align_stages(self, timeout_s: float = 600.0) -> bool:
        """Bring every stage to ``plan`` (after a reconnect, stages may still hold the ranges
        of an earlier elastic repartition). True when something had to move."""
        if self.plan is None:
            return False
        want = [(r.start, r.end) for r in self.plan]
        reports = await self.stage_status()
        if [r.layers for r in reports] == want:
            return False
        await self.move_stages(self.plan, timeout_s)
        return True

    async def verify_identities(self, links: list[StageLink]) -> None:
        """Compare what each stage serves with the cluster's copy; ModelMismatch if any
        differs, holds none, or cannot run the family."""
        if self.identity is None:
            return
        self.identity_checks = await check_links(self.identity, links, self.ask)
        refuse_mismatches(self.identity_checks)

    async def move_stages(
        self, target: tuple[LayerRange, ...], prepare_timeout_s: float
    ) -> list[ReassignReply]:
        """The two-phase move to new layer ranges, the one place it is written: every stage
        prepares its new range beside the old one (loading only the layers it gains), then,
        only when all are ready, every stage commits; one refusal aborts everywhere. Returns
        the prepare replies (what each stage loaded); the plan becomes ``target``."""
        replies = await self.reassign("prepare", target, prepare_timeout_s)
        refused = [(i, str(r.error)) for i, r in enumerate(replies) if not r.ok]
        if refused:
            with contextlib.suppress(BackendUnavailable):
                await self.reassign("abort", target, 30.0)
            errors = "; ".join(error for _, error in refused)
            raise LayerMoveError(
                f"stages could not load the planned layers: {errors}", refused, committed=False
            )
        committed = await self.reassign("commit", target, 60.0)
        failed = [(i, str(r.error)) for i, r in enumerate(committed) if not r.ok]
        if failed:
            # A commit is a pointer swap; failing here means a stage is broken, not busy.
            raise LayerMoveError(
                f"a stage failed to switch layers: {failed}", failed, committed=True
            )
        self.plan = target
        await self.verify_chain()
        return replies

    async def verify_chain(self) -> None:
        """Check every stage of the chain again (after a layer move or a stage's reload);
        layers that are not the cluster's break the pipeline: nothing is served from them."""
        try:
            await self.verify_identities(self._links)
        except ModelMismatch as exc:
            self._broken = str(exc)
            raise

    async def _poll_stages(self, every_s: float = 1.0) -> None:
        """Stage reports for the metrics: one scrape of the coordinator covers the cluster."""
        assert self.metrics is not None
        while True:  # until close() ends it: a pipeline lost for good may come back
            if self._broken is None:
                with contextlib.suppress(BackendUnavailable):
                    reports = await self.stage_status()
                    self.metrics.record_stage_reports(time.monotonic(), reports)
            await asyncio.sleep(every_s)

    def _rdma_fallbacks(self) -> int:
        state = getattr(self.transport, "state", None)
        if state is None:
            return 0
        return int(state.fallback_reason is not None) + int(state.peer_fallbacks)

    async def flush_trace(self) -> bool:
        """Merge every node's events into the trace file, once (a second call does nothing)."""
        if self._trace_file is None or self._trace_file.written:
            return False
        events = self.trace.take()
        for link in self._links:
            if link.alive:
                with contextlib.suppress(BackendUnavailable), self._answering(link):
                    events.extend(await stage_trace_events(link.control))
        return self._trace_file.flush(events)

    async def stage_status(self) -> list[StageReport]:
        """Each stage's own report (KV use, busy fraction, forwards)."""
        return [await self._request(link, Status(), StageReport) for link in self._links]

    async def set_stage_admission(self, open_: bool, state: str) -> None:
        """Open or close admission on every stage (an elastic drain), reporting ``state``."""
        command = Admission(open=open_, state=state)
        await asyncio.gather(*(self._request(link, command, Ack) for link in self._links))

    async def reassign(
        self, phase: Literal["prepare", "commit", "abort"], plan: tuple[LayerRange, ...],
        timeout_s: float,
    ) -> list[ReassignReply]:  # fmt: skip
        """One phase of an elastic resume on every stage; each stage's reply, in stage order."""
        command = Reassign(phase=phase, plan=[(r.start, r.end) for r in plan])
        return list(
            await asyncio.gather(
                *(self._request(link, command, ReassignReply, timeout_s) for link in self._links)
            )
        )

    def health(self) -> Health:
        stages = tuple(
            {"stage": i, "node": link.node.id, "address": link.node.address, "alive": link.alive}
            for i, link in enumerate(self._links)
        )
        if self._broken is not None:
            return Health(ready=False, detail=self._broken, stages=stages)
        if not self._recovered.is_set():
            return Health(ready=False, detail=f"recovering: {self._recovering}", stages=stages)
        if not self._ready:
            return Health(
                ready=False, detail="starting: connecting and warming stages", stages=stages
            )
        return Health(ready=True, detail="all stages connected", stages=stages)

    async def stage_reports(self) -> dict[str, StageReport | None]:
        """Each connected stage's report by node id; None for a stage that did not answer."""

        async def one(link: StageLink) -> StageReport | None:
            if not link.alive:
                return None
            try:
                return await self._request(link, Status(), StageReport)
            except BackendUnavailable:
                return None

        replies = await asyncio.gather(*(one(link) for link in self._links))
        return {link.node.id: reply for link, reply in zip(self._links, replies, strict=True)}

    # -- admission: a dry run on every stage, then the commit --------------------------------

    async def _admit(
        self, seq: str, prompt: list[int], params: SamplingParams, first_draw: int = 0
    ) -> None:
        """Coordinated admission; a stage's full KV budget first evicts kept prompt prefixes
        (least recently used first), then refuses."""
        while True:
            try:
                return await self._admit_once(seq, prompt, params, first_draw)
            except AdmissionRejected as exc:
                oldest = self.prompts.oldest() if self.prompts is not None else None
                if oldest is None or exc.diagnostic.reason is not RejectReason.MEMORY:
                    raise
                await self.forget_prompts([oldest])

    async def _admit_once(
        self, seq: str, prompt: list[int], params: SamplingParams, first_draw: int
    ) -> None:
        plan = [(r.start, r.end) for r in self.plan] if self.plan is not None else None
        spec = params.sampler_spec(prompt)
        # The sampler's extras go to the last stage only, as a JSON payload.
        sampler = np.frombuffer(spec.model_dump_json().encode(), np.uint8) if spec else None
        last = len(self._links) - 1
        for commit in (False, True):
            command = Admit(
                seq=seq, prompt_tokens=len(prompt), max_tokens=params.max_tokens, commit=commit,
                temperature=params.temperature, top_p=params.top_p, seed=params.seed, plan=plan,
                first_draw=first_draw, adapter=params.adapter,
            )  # fmt: skip
            replies = await asyncio.gather(
                *(
                    self._request(link, command, AdmitReply, payload=sampler if i == last else None)
                    for i, link in enumerate(self._links)
                )
            )
            refusals = [r.refusal(i) for i, r in enumerate(replies)]
            refused = [d for d in refusals if d is not None]
            if refused:
                if commit:  # another request took the room between dry run and commit
                    await self._release(seq)
                diagnostic = refused[0]
                self._rejected(seq, diagnostic)
                if diagnostic.reason in (RejectReason.DRAINING, RejectReason.PLAN_MISMATCH):
                    raise AdmissionClosed(diagnostic.message())
                if diagnostic.reason is RejectReason.INVALID_REQUEST:
                    raise RequestRefused(diagnostic.message())
                raise AdmissionRejected(diagnostic)

    def _rejected(self, seq: str, d: AdmissionDiagnostic) -> None:
        """An OOM diagnostic: one log line, the counter, a trace event."""
        log.warning(
            "admission rejected: %s stage=%d%s reason=%s required=%d used=%d budget=%d active=%d",
            seq, d.stage_index, "" if d.rank is None else f" rank={d.rank}", d.reason.value,
            d.required_bytes, d.used_memory_bytes, d.budget_bytes, d.active_sequences,
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.rejections.labels(stage=str(d.stage_index), reason=d.reason.value).inc()
        self.trace.instant(
            "admission_reject", 0, seq=seq, stage=d.stage_index, rank=d.rank,
            reason=d.reason.value,
            required_bytes=d.required_bytes, available_bytes=d.available_bytes,
        )  # fmt: skip

    async def _release(self, seq: str, keep: tuple[int, ...] | None = None, tag: str = "") -> None:
        """Free ``seq`` on every stage; ``keep``: the tokens its caches hold, to keep them as
        a prompt-cache entry instead (``core/prompt_cache.py``), reused only by requests of
        the same ``tag`` (the adapter: its caches hold that adapter's keys and values)."""
        command = Release(seq=seq)
        evicted: list[str] = []
        if keep and self.prompts is not None and self.prompts.capacity:
            entry = f"pc.{seq}"
            command = Release(seq=seq, keep=entry, keep_tokens=len(keep))
            evicted = self.prompts.add(entry, keep, tag)
        for link in self._links:
            if link.alive:
                with contextlib.suppress(ChannelClosedError, FrameError):
                    await link.control.tell(command)
        if evicted:
            await self.forget_prompts(evicted)

    async def forget_prompts(self, entries: list[str]) -> None:
        """Every stage drops these prompt-cache entries."""
        if self.prompts is not None:
            for entry in entries:
                self.prompts.forget(entry)
        for link in self._links:
            if link.alive:
                with contextlib.suppress(ChannelClosedError, FrameError):
                    await link.control.tell(Forget(entries=entries))

    async def _heartbeats(self) -> None:
        """Tell every stage this coordinator is alive, every interval."""
        assert self.failover is not None
        beat = Heartbeat().model_dump()
        while True:
            for link in list(self._links):
                if link.alive:
                    try:
                        await link.channel.send(MessageKind.CONTROL, beat)
                    except ChannelClosedError as exc:
                        self._fail(link, f"stage {link.node.id} was lost: {exc}")
            await asyncio.sleep(self.failover.heartbeat_interval_s)
