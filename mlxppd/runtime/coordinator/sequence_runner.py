"""One sequence's path through the pipeline, start to end, in one place.

A request takes a slot (``--parallel``), is admitted on every stage (``admission.py``), sends
its prompt into stage 0 (``prompt_sender.py``), then reads each token from its queue and queues
the next decode step (alone, or in its micro-batch: ``sequence_router.py``) before handing the
token out; at the end every stage frees it or keeps its caches as a prompt-cache entry. A stage
lost under it (``PipelineInterrupted``) pauses it; once a new pipeline serves, it is admitted
again with its prompt plus the tokens it had produced and goes on from the next token.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace

from mlxppd.core.prompt_cache import Reuse
from mlxppd.runtime.backends.contract import SamplingParams, SequenceFailed, TokenEvent
from mlxppd.runtime.coordinator.adapter_registry import AdapterRegistry
from mlxppd.runtime.coordinator.admission import SequenceAdmission
from mlxppd.runtime.coordinator.prompt_sender import PromptSender
from mlxppd.runtime.coordinator.recovery import PipelineInterrupted
from mlxppd.runtime.coordinator.sequence_router import Item, SequenceRouter
from mlxppd.runtime.coordinator.shared_prefill import SharedPrefill
from mlxppd.runtime.coordinator.speed_meter import SpeedMeter
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.trace import TraceBuffer

log = logging.getLogger("mlxppd.coordinator")

#: the longest a finished sequence waits for its last step in flight before it is freed anyway
#: (a lost stage fails the step much sooner: its heartbeat times out first)
_SETTLE_S = 30.0


class SequenceRunner:
    """Runs every sequence of the coordinator on the parts it is given."""

    def __init__(
        self,
        *,
        admission: SequenceAdmission,
        sender: PromptSender,
        router: SequenceRouter,
        meter: Callable[[], SpeedMeter],
        adapters: AdapterRegistry,
        await_serving: Callable[[], Awaitable[None]],
        parallel: int,
        eos: set[int],
        replays: bool,
        trace: TraceBuffer,
        metrics: PipelineMetrics | None,
    ) -> None:
        self._admission = admission
        self._sender = sender
        self._router = router
        self._meter = meter
        self._adapters = adapters
        #: waits out a failover; raises when the pipeline is down
        self._await_serving = await_serving
        # --parallel: sequences generating at once; later requests wait for a slot.
        self._slots = asyncio.Semaphore(parallel)
        self._eos = eos
        #: a failover may replay sequences (their sampling must then be seeded)
        self._replays = replays
        self._trace = trace
        self._metrics = metrics
        self._seq = itertools.count()
        self.waiting = 0
        self.active = 0

    def generate_choices(
        self, request_id: str, prompt: list[int], params: Sequence[SamplingParams]
    ) -> list[AsyncIterator[TokenEvent]]:
        """The ``n`` choices of one prompt, its prefill computed once (``shared_prefill.py``)."""
        seqs = [f"{request_id}.{next(self._seq)}" for _ in params]
        share = SharedPrefill(seqs) if len(params) > 1 and len(prompt) > 1 else None
        return [
            self.generate(request_id, prompt, p, seq=q, share=share)
            for p, q in zip(params, seqs, strict=True)
        ]

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        seq: str | None = None,
        share: SharedPrefill | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """``share``: this choice leads or follows its prompt's shared prefill."""
        seq = seq or f"{request_id}.{next(self._seq)}"
        if share is not None and seq != share.leader_seq:
            # Wait for the leader's head before taking a slot (the leader may need one).
            if await share.source() is None:
                share = None  # it failed first: prefill alone
        try:
            await self._await_serving()
        except BaseException:
            _leader_gone(share, seq)
            raise
        if not prompt:
            raise ValueError("the prompt is empty")
        self._trace.instant("batch_arrival", 0, seq=seq, prompt_tokens=len(prompt))
        self.waiting += 1
        try:
            await self._slots.acquire()
        except BaseException:
            _leader_gone(share, seq)
            raise
        finally:
            self.waiting -= 1
        try:
            self._adapters.begin(params.adapter)
        except BaseException:
            self._slots.release()
            _leader_gone(share, seq)
            raise
        self.active += 1
        started = last = time.monotonic()
        produced = 0
        try:
            async for item in self._replayed(seq, prompt, params, share):
                now = time.monotonic()
                if self._metrics is not None:
                    if produced == 0:
                        self._metrics.prompt_tokens.inc(len(prompt))
                        self._metrics.ttft.observe(now - started)
                    else:
                        self._metrics.itl.observe(now - last)
                    self._metrics.generation_tokens.inc()
                produced += 1
                last = now
                yield item
        finally:
            self.active -= 1
            self._adapters.end(params.adapter)
            self._slots.release()

    async def _replayed(
        self, seq: str, prompt: list[int], params: SamplingParams,
        share: SharedPrefill | None = None,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """The sequence's tokens; a stage lost under it pauses it, and once the pipeline is
        back it is admitted again with prompt + the tokens sent so far, going on from there."""
        if self._replays and params.temperature > 0 and params.seed is None:
            # A replay must draw what the first run would have: fix the seed now.
            params = replace(params, seed=secrets.randbits(64))
        produced: list[int] = []
        tag = params.adapter or ""
        reuse = self._admission.match(prompt, tag) if not share else None
        for attempt in itertools.count():
            try:
                # A replay runs on a new chain, which holds none of the old chain's entries.
                async for item in self._generate(
                    f"{seq}~{attempt}" if attempt else seq, [*prompt, *produced], params,
                    len(produced), None if attempt else share, None if attempt else reuse,
                ):  # fmt: skip
                    produced.append(item.token)
                    yield item
                return
            except _CacheMiss:
                # A stage lacks the kept prefix (restarted, or it could not cut it): forget
                # it everywhere and compute the prompt in full.
                assert reuse is not None
                await self._admission.forget([reuse.entry])
                reuse = None
            except PipelineInterrupted:
                await self._await_serving()
                log.info("coordinator: replaying %s from token %d", seq, len(produced))
                if self._metrics is not None:
                    self._metrics.sequences_replayed.inc()

    async def _generate(
        self, seq: str, prompt: list[int], params: SamplingParams, done: int = 0,
        share: SharedPrefill | None = None, reuse: Reuse | None = None,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """One run of a sequence whose first ``done`` tokens were sent already (a replay);
        ``share``: its prompt's shared prefill (``shared_prefill.py``)."""
        params = replace(params, max_tokens=params.max_tokens - done)
        try:
            await self._admission.admit(seq, prompt, params, first_draw=done)
        except BaseException:
            _leader_gone(share, seq)
            if share is not None and seq != share.leader_seq:
                await self._admission.release(seq)  # the copies of the leader's head it holds
            raise
        queue = self._router.open(seq)
        tokens: list[int] = []
        final = False
        # A step of this sequence alone (its prefill, or a decode step outside a micro-batch)
        # is on its way: the stages may free it only once that step's answer is back.
        outstanding = False
        try:
            step = await self._sender.prefill(seq, prompt, params, share, reuse)
            outstanding = True
            pending: asyncio.Future[TokenEvent] | None = None
            for produced in range(params.max_tokens):
                if pending is None:
                    got = await queue.get()
                    outstanding = False
                    if isinstance(got, SequenceFailed) and reuse is not None and not produced:
                        raise _CacheMiss() from got
                    if isinstance(got, Exception):
                        raise got
                    item = got
                else:
                    item = await pending
                self._meter().token(seq)
                if produced == 0 and reuse is not None:
                    item = replace(item, cached=reuse.tokens)
                tokens.append(item.token)
                eos = item.token in self._eos
                if produced + 1 < params.max_tokens and not eos:
                    # Queue the next step before handing this token out: the pipeline works
                    # while the caller detokenizes and streams.
                    batcher = self._router.batcher
                    if batcher is not None:
                        # Decode steps join a micro-batch; the prefill ran on its own. A
                        # sequence reporting top logprobs joins too: the last stage returns
                        # each member's own (``BatchTokenMeta.tops``).
                        pending = batcher.submit(seq, item.token, params.logprobs)
                    else:
                        step += 1
                        outstanding = True
                        await self._sender.send_input(
                            seq, step, [item.token], True, params.logprobs
                        )
                # The last token: nothing more runs, so the caches hold prompt + all but it.
                final = eos or produced + 1 == params.max_tokens
                if final:
                    # Out of its micro-batch now, not when the caller closes this iterator:
                    # a caller may stop reading at EOS, and the group waits for every member.
                    self._router.leave(seq)
                yield item
                if eos:
                    return
        finally:
            try:
                await self._settle(seq, queue if outstanding else None)
            finally:
                self._meter().ended(seq)
                keep = (*prompt, *tokens[:-1]) if final else None
                await self._admission.release(seq, keep, params.adapter or "")

    async def _settle(self, seq: str, queue: asyncio.Queue[Item] | None) -> None:
        """Wait (bounded) until no step of ``seq`` is in flight: a Release overtaking one made
        the stage that had freed it fail the step (and, before, its whole micro-batch).
        ``queue``: the sequence's own step is outstanding and answers there."""
        try:
            if queue is not None:
                await asyncio.wait_for(queue.get(), _SETTLE_S)
            settled = self._router.close(seq)
            if settled is not None:
                await asyncio.wait_for(settled, _SETTLE_S)
        except TimeoutError:
            log.warning("coordinator: %s still had a step in flight after %.0f s", seq, _SETTLE_S)
        finally:
            self._router.close(seq)


def _leader_gone(share: SharedPrefill | None, seq: str) -> None:
    """A leader that fails before sending its head lets its followers prefill alone."""
    if share is not None and seq == share.leader_seq:
        share.head_done(None)


class _CacheMiss(Exception):
    """A stage could not start a sequence from its kept prefix: run it without."""
