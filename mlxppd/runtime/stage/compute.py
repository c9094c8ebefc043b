"""A stage worker's data plane: each input run in arrival order on the mlx thread, its result
queued for the sender task, so the next forward computes while the previous activation is on
the wire. A part of ``StageWorker`` (``worker.py``) over the shared ``StageState``; its output
queue, the sequences that failed here and the mlx threads' setting are its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import mlx.core as mx
import numpy as np

from mlxppd.core.log_text import escape
from mlxppd.core.log_throttle import LogThrottle
from mlxppd.core.protocol.control import clip
from mlxppd.core.protocol.pipeline import (
    BatchForwardMeta,
    BatchTokenMeta,
    ForwardMeta,
    GroupFailure,
    SequenceFailure,
    TokenMeta,
    split_answer,
)
from mlxppd.engine.sampling import Sampled
from mlxppd.engine.stage_runner import EntryMissing, RowFailed, StageRunner
from mlxppd.engine.stage_threads import StageThreads
from mlxppd.engine.tp_mirror import MirroredRunner
from mlxppd.engine.wire_tensors import from_wire, to_wire
from mlxppd.runtime.observability.trace import now_us
from mlxppd.runtime.stage.state import StageState
from mlxppd.runtime.stage.work import (
    ForgetWork,
    ForwardWork,
    GroupWork,
    Output,
    ReleaseAllWork,
    ReleaseWork,
    SwapWork,
)
from mlxppd.wire.codec import Message, MessageKind, metadata_bytes
from mlxppd.wire.errors import ChannelClosedError

log = logging.getLogger("mlxppd.stage")


def _free(runner: StageRunner, held: ReleaseAllWork) -> None:
    for seq in held.seqs:
        runner.release(seq)
    for entry in held.entries:
        runner.forget(entry)


class StageCompute:
    """The compute loop and the sender task of one stage."""

    def __init__(self, state: StageState) -> None:
        self._state = state
        self._out: asyncio.Queue[Output] = asyncio.Queue()
        # Sequences that failed here: their queued inputs are skipped until released.
        self._failed: set[str] = set()
        self._threads = StageThreads()
        self._stale_log = LogThrottle(30.0)
        #: work items the compute loop finished (an idle stage's give-back checks it moved not)
        self._done = 0

    async def accept_activation(self, message: Message) -> None:
        """Queue an input for the compute loop: one sequence's, or a micro-batch's."""
        if "group" in message.meta:
            batch = BatchForwardMeta.model_validate(dict(message.meta))
            self._arrived(batch.sent_at, message)
            await self._state.work.put(GroupWork(batch, message.tensor))
        else:
            meta = ForwardMeta.model_validate(dict(message.meta))
            self._arrived(meta.sent_at, message)
            await self._state.work.put(ForwardWork(meta, message.tensor))

    def _arrived(self, sent_at: float | None, message: Message) -> None:
        nbytes = message.tensor.nbytes if message.tensor is not None else 0
        if sent_at is not None:
            self._state.latency.observe(time.time() - sent_at)
        index = self._state.spec.index
        self._state.trace.instant("activation_recv", index, bytes=nbytes, direction="recv")

    async def compute_loop(self) -> None:
        s = self._state
        while True:
            item = await s.work.get()
            if isinstance(item, ForwardWork):
                await self._forward(item.meta, item.tensor)
            elif isinstance(item, GroupWork):
                await self._forward_group(item.meta, item.tensor)
            elif isinstance(item, ReleaseWork):
                self._failed.discard(item.seq)
                # The accounting changed when the release arrived (admission.py).
                if item.keep is None or not await self._keep_here(item):
                    if item.keep is not None:
                        s.kv.unpin(item.keep)  # not kept after all
                    await self._release_here(item.seq)
            elif isinstance(item, ForgetWork):
                for entry in item.entries:
                    if s.runner is not None:
                        await s.mlx.run(functools.partial(s.runner.forget, entry))
            elif isinstance(item, ReleaseAllWork):
                # The accounting went when the coordinator did (StageState.release_accounting);
                # a new one's admissions since then stay.
                self._failed.difference_update(item.seqs)
                if s.runner is not None:
                    await s.mlx.run(functools.partial(_free, s.runner, item))
            elif isinstance(item, SwapWork):
                s.spec, s.runner, s.kv = item.spec, item.runner, item.kv
                s.clock.set_active(len(item.kv.reserved), time.monotonic())
                item.done.set_result(None)
            self._done += 1
            if isinstance(item, ReleaseWork | ReleaseAllWork | ForgetWork) and self._idle():
                s.side_tasks.spawn(self._give_back(self._done), name="stage-cache-give-back")

    def _idle(self) -> bool:
        """No sequence held and nothing queued."""
        return not self._state.kv.reserved and self._state.work.qsize() == 0

    async def _give_back(self, done: int) -> None:
        """mlx's cache back to the OS once the stage stayed idle a moment (not between two
        back-to-back requests: the next prefill would fault its buffers in again)."""
        await asyncio.sleep(self._state.cache.idle_after_s)
        if self._done == done and self._idle():
            await self._state.mlx.run(self._state.cache.idle)

    def _computed(self, started: float, start_us: float, rows: int) -> None:
        elapsed = time.monotonic() - started
        s = self._state
        s.stats.busy_s += elapsed
        s.stats.forwards += 1
        s.clock.busy(elapsed)
        s.trace.span("stage", s.spec.index, start_us, now_us(), rows=rows)

    async def _forward(self, meta: ForwardMeta, tensor: Any) -> None:
        if meta.seq in self._failed:
            return  # the rest of a failed sequence's prefill: its request has been told
        s = self._state
        if meta.seq not in s.kv.reserved:
            # Released or never admitted here (an old pipeline's step after a SIGCONT, a step
            # that lost a race with its release): running it would make caches nobody frees.
            await self._stale([meta.seq])
            return
        started = time.monotonic()
        sample = meta.sample and s.spec.has_lm_head

        def run() -> Any:
            self._threads.before_pass(False)
            x = from_wire(tensor)
            if meta.cached is not None:
                s.layers().start_from(meta.cached[0], meta.seq, meta.cached[1])
            if sample:
                return s.layers().forward_and_sample(meta.seq, x, meta.logprobs)
            out = to_wire(s.layers().forward(meta.seq, x))
            for seq in meta.forks or ():
                s.layers().fork(meta.seq, seq)
            return out

        start_us = now_us()
        try:
            result = await s.mlx.run(run)
        except Exception as exc:
            # This input cannot run here (a bad tensor, a family's forward or the sampler
            # raising): only its sequence fails; the link and every other sequence carry on.
            await self._sequence_failed(meta.seq, exc)
            return
        self._computed(started, start_us, rows=1)
        if s.spec.has_lm_head:
            if sample:
                token = np.array([result.token], dtype=np.int32)
                top = list(result.top) if result.top is not None else None
                out = TokenMeta(seq=meta.seq, step=meta.step, logprob=result.logprob, top=top)
                await self._out.put((MessageKind.TOKENS, out, token))
            return
        await self._out.put((MessageKind.ACTIVATION, meta, result))

    async def _keep_here(self, item: ReleaseWork) -> bool:
        """Keep a released sequence's caches as a prompt-cache entry (False: not kept)."""
        s = self._state
        if s.runner is None or item.keep is None:
            return False
        keep = functools.partial(s.runner.keep, item.seq, item.keep, item.keep_tokens)
        try:
            return bool(await s.mlx.run(keep))
        except Exception as exc:  # the entry is simply not there: its reuse falls back
            log.warning("stage %d: cannot keep %s: %s", s.spec.index, escape(item.seq), exc)
            return False

    async def _release_here(self, seq: str) -> None:
        if (runner := self._state.runner) is not None:
            await self._state.mlx.run(functools.partial(runner.release, seq))

    def _check_ring(self) -> None:
        runner = self._state.runner
        if isinstance(runner, MirroredRunner) and runner.broken:
            self.rank_lost("a tensor-parallel rank is gone")

    def rank_lost(self, why: str) -> None:
        """A tensor-parallel rank of this stage is gone: nothing more computes here until the
        stage's ranks start again together (whoever runs this node restarts it)."""
        s = self._state
        if isinstance(s.runner, MirroredRunner):
            s.runner.broken = True
        if not s.ring_lost.is_set():
            log.error("stage %d: %s; this stage stops", s.spec.index, why)
        s.ring_lost.set()

    async def _sequence_failed(self, seq: str, exc: Exception) -> None:
        self._check_ring()
        index = self._state.spec.index
        self._state.stats.sequence_failures += 1
        # A missed prompt-cache entry costs a prefill, not a request (sequence_runner.py).
        level = logging.INFO if isinstance(exc, EntryMissing) else logging.ERROR
        log.log(level, "stage %d: sequence %s failed: %s", index, escape(seq), exc)
        self._failed.add(seq)
        await self._release_here(seq)
        failure = SequenceFailure(seq=seq, stage=index, message=clip(str(exc), 1000))
        await self._out.put((MessageKind.ERROR, failure, None))

    async def _stale(self, seqs: list[str]) -> None:
        """Steps of sequences this stage does not hold: dropped, counted, and each one's
        request told (alone; a coordinator that already let it go ignores the failure)."""
        s = self._state
        s.stats.stale_steps += len(seqs)
        if (counts := self._stale_log.note("stale steps")) is not None:
            log.info("stage %d: dropped %s of sequences not held here", s.spec.index, counts)
        for seq in seqs:
            message = f"sequence {seq} is not held on stage {s.spec.index} (released already)"
            failure = SequenceFailure(seq=seq, stage=s.spec.index, message=message)
            await self._out.put((MessageKind.ERROR, failure, None))

    def _held_rows(self, meta: BatchForwardMeta) -> list[int]:
        """The rows of a micro-batch step whose sequences this stage holds."""
        s = self._state
        if s.runner is None:
            return list(range(len(meta.seqs)))  # a standby: refused below, as a whole
        runner = s.runner
        return [
            i
            for i, seq in enumerate(meta.seqs)
            if seq not in self._failed and seq in s.kv.reserved and runner.holds(seq)
        ]

    async def _forward_group(self, meta: BatchForwardMeta, tensor: Any) -> None:
        s = self._state
        held = self._held_rows(meta)
        if len(held) < len(meta.seqs):
            # A member released or failed here rides no further; the others go on.
            await self._stale([seq for i, seq in enumerate(meta.seqs) if i not in set(held)])
            if not held:
                return
        rows = held if len(held) < len(meta.seqs) else None
        if rows is not None:
            meta = meta.model_copy(update={"seqs": [meta.seqs[i] for i in rows]})
        started = time.monotonic()
        last = s.spec.has_lm_head

        def run() -> Any:
            self._threads.before_pass(meta.solo)
            x = from_wire(tensor)
            if rows is not None and x.shape[0] > max(rows):
                x = x[mx.array(rows)]
            if x.shape[0] != len(meta.seqs):
                raise ValueError(f"{x.shape[0]} rows for {len(meta.seqs)} sequences")
            if last:
                return s.layers().forward_group_and_sample(meta.group, meta.seqs, x, meta.logprobs)
            return to_wire(s.layers().forward_group(meta.group, meta.seqs, x))

        start_us = now_us()
        try:
            result = await s.mlx.run(run)
        except Exception as exc:
            # This group cannot run here (a malformed batch, a cache kind that cannot batch):
            # drop its state and tell the coordinator, which fails its requests cleanly.
            log.error("stage %d: micro-batch %s failed: %s", s.spec.index, meta.group, exc)
            self._check_ring()
            for seq in meta.seqs:
                await self._release_here(seq)
            error = GroupFailure(group=meta.group, seqs=meta.seqs, message=clip(str(exc), 1000))
            await self._out.put((MessageKind.ERROR, error, None))
            return
        self._computed(started, start_us, rows=len(meta.seqs))
        s.stats.batched_passes += 1
        s.stats.batched_rows += len(meta.seqs)
        if last:
            await self._answer_group(meta, result)
            return
        await self._out.put((MessageKind.ACTIVATION, meta, result))

    async def _answer_group(self, meta: BatchForwardMeta, rows: list[Sampled | RowFailed]) -> None:
        """Send the coordinator a sampled group step: each member's failure alone, then the
        others' tokens (in parts when they would not fit one message's metadata)."""
        sampled = list(zip(meta.seqs, rows, strict=True))
        for seq, row in sampled:
            if isinstance(row, RowFailed):
                await self._sequence_failed(seq, ValueError(row.message))
        good = [(q, r) for q, r in sampled if isinstance(r, Sampled)]
        if not good:
            return
        tokens = np.array([r.token for _, r in good], dtype=np.int32)
        # A member reporting top logprobs gets them in its row (None for the others).
        tops = [list(r.top) if r.top is not None else None for _, r in good]
        out = BatchTokenMeta(
            group=meta.group,
            seqs=[q for q, _ in good],
            step=meta.step,
            logprobs=[r.logprob for _, r in good] if meta.logprobs else None,
            tops=tops if any(t is not None for t in tops) else None,
        )
        limit = self._state.transport.config.limits.max_metadata_bytes
        for part, part_rows in split_answer(out, lambda m: metadata_bytes(m.model_dump()) <= limit):
            await self._out.put((MessageKind.TOKENS, part, tokens[part_rows]))

    async def send_loop(self) -> None:
        s = self._state
        while True:
            kind, meta, tensor = await self._out.get()
            to_coordinator = kind in (MessageKind.TOKENS, MessageKind.ERROR)
            target = s.coordinator if to_coordinator else s.downstream
            if target is None:
                log.warning("stage %d: no %s channel; dropping output", s.spec.index, kind.name)
                continue
            if kind is MessageKind.ACTIVATION:
                meta = meta.model_copy(update={"sent_at": time.time()})
                nbytes = tensor.nbytes if tensor is not None else 0
                s.trace.instant("activation_send", s.spec.index, bytes=nbytes, direction="send")
            try:
                await target.send(kind, meta.model_dump(), tensor)
            except ChannelClosedError as exc:
                log.error("stage %d: sending %s failed: %s", s.spec.index, kind.name, exc)
                coordinator = s.coordinator
                if target is s.downstream and coordinator is not None:
                    # The next stage is unreachable from here: the sequences in flight cannot
                    # go on. Dropping the coordinator's link starts its failover, which
                    # rebuilds the chain (and this stage's link to whoever is next).
                    await coordinator.close()
