"""A sequence's KV on a stage: admitting it (a dry run, then the commit, with the last stage's
sampler made at admission), releasing it (its caches kept as a prompt-cache entry or not) and
forgetting kept entries. The accounting changes as the command arrives; the caches go in order
on the compute loop (``compute.py``). A part of ``StageWorker`` over the shared ``StageState``.

A commit whose sampler needs an output grammar is answered once the grammar is ready: the
tokenizer and the compile run on the grammar pool's threads (``engine/grammar_compiles.py``),
never on this event loop (which reads the coordinator's heartbeats and sends this stage's) nor
on the mlx thread, and the read loop goes on to the next command meanwhile. Its KV is counted
at arrival like any commit's, and given back if the grammar is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from mlxppd.core.kv_admission import AdmissionDiagnostic, AdmissionRequest, RejectReason
from mlxppd.core.log_text import escape
from mlxppd.core.protocol.control import Admit, AdmitRefusal, AdmitReply, Forget, Release
from mlxppd.core.protocol.sampling import GrammarSpec, SamplerSpec, parse_sampler_spec
from mlxppd.engine.grammar import Constraint
from mlxppd.engine.grammar_compiles import GrammarCompiles, GrammarTooSlow
from mlxppd.engine.sampling import SequenceSampler, make_sampler
from mlxppd.runtime.stage.state import StageState, send_reply
from mlxppd.runtime.stage.work import ForgetWork, ReleaseWork
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Tensor

log = logging.getLogger("mlxppd.stage")

T = TypeVar("T")


@dataclass(frozen=True)
class _Sampling:
    """The last stage's sampler of one sequence, and the grammar it still needs (if any)."""

    sampler: SequenceSampler
    grammar: GrammarSpec | None
    vocab: int
    """the logits width"""
    replay: tuple[int, ...]
    """what the grammar follows first (a replayed sequence's tokens)"""


class _Refused(Exception):
    """The sampler parameters this stage cannot serve; the message says why, in one line."""


class StageAdmission:
    """Admit, Release and Forget on a stage."""

    def __init__(self, state: StageState, grammars: GrammarCompiles | None = None) -> None:
        self._state = state
        # The last stage compiles output grammars against the tokenizer, loaded on first use.
        self.grammars = grammars or GrammarCompiles(None)

    async def on_admit(self, channel: SecureChannel, command: Admit, tensor: Tensor | None) -> None:
        admitted = self._admit(command, tensor)
        if isinstance(admitted, AdmitReply):
            await send_reply(channel, admitted)
            return
        # The reply waits for the grammar; the read loop does not (heartbeats, other commands).
        self._state.side_tasks.spawn(
            self._commit_grammar(channel, command, admitted), name="stage-admit-grammar"
        )

    async def on_release(
        self, channel: SecureChannel, command: Release, tensor: Tensor | None
    ) -> None:
        # The budget frees at once, as for Forget: the coordinator gives the sequence's slot
        # to a waiting request right after, whose admission may arrive before the compute
        # loop reaches this release (it was refused "already holds 64 sequences" at a full
        # --parallel). A kept prefix is counted at once too; the caches go in order.
        s = self._state
        s.kv.release(command.seq)
        if command.keep is not None:
            s.kv.pin(command.keep, command.keep_tokens)
        s.clock.set_active(len(s.kv.reserved), time.monotonic())
        await s.work.put(ReleaseWork(command.seq, command.keep, command.keep_tokens))

    async def on_forget(
        self, channel: SecureChannel, command: Forget, tensor: Tensor | None
    ) -> None:
        # The budget frees at once (an admission may follow on this channel right away);
        # the caches go in order on the compute loop.
        for entry in command.entries:
            self._state.kv.unpin(entry)
        await self._state.work.put(ForgetWork(tuple(command.entries)))

    def close(self) -> None:
        self.grammars.close()

    def _admit(self, command: Admit, payload: Any = None) -> AdmitReply | _Sampling:
        """The reply, or at a commit whose sampler needs a grammar, that sampler: its reply
        waits for the grammar (``_commit_grammar``)."""
        s = self._state
        request = AdmissionRequest(command.seq, command.prompt_tokens, command.max_tokens)
        problem = (
            self._closed_reason(command) or s.kv.dry_run(request) or self._adapter_refused(command)
        )
        if problem is not None:
            return _refusal(command, problem)
        try:
            sampling = self._sampling(command, payload)
        except Exception as exc:
            refused = s.kv.refusal(RejectReason.INVALID_REQUEST)
            return self._refused(command, refused, _sentence(exc))
        if not command.commit:
            if sampling is not None and sampling.grammar is not None:
                self.grammars.ready(sampling.vocab)  # the tokenizer loads as the others answer
            return AdmitReply(rid=command.rid, ok=True)
        if command.adapter is not None:
            s.layers().set_adapter(command.seq, command.adapter)
        s.kv.commit(request)
        s.clock.set_active(len(s.kv.reserved), time.monotonic())
        if sampling is None:
            return AdmitReply(rid=command.rid, ok=True)
        if sampling.grammar is None:
            s.layers().set_sampler(command.seq, sampling.sampler)
            return AdmitReply(rid=command.rid, ok=True)
        return sampling

    async def _commit_grammar(
        self, channel: SecureChannel, command: Admit, sampling: _Sampling
    ) -> None:
        """The rest of a commit whose sampler needs a grammar: the reply once it is ready."""
        s = self._state
        constraint: Constraint | None = None
        why = ""
        try:
            constraint = await self._constraint(sampling)
        except Exception as exc:
            why = _sentence(exc)
        if channel.closed or command.seq not in s.kv.reserved:
            return  # the coordinator that asked is gone, and its sequences were freed
        if constraint is not None:
            sampling.sampler.constraint = constraint
            s.layers().set_sampler(command.seq, sampling.sampler)
            await send_reply(channel, AdmitReply(rid=command.rid, ok=True))
            return
        # Not admitted after all: its budget back now, as a Release would give it.
        s.kv.release(command.seq)
        s.clock.set_active(len(s.kv.reserved), time.monotonic())
        if command.adapter is not None:
            s.layers().set_adapter(command.seq, None)
        problem = s.kv.refusal(RejectReason.INVALID_REQUEST)
        await send_reply(channel, self._refused(command, problem, why))

    def _refused(self, command: Admit, problem: AdmissionDiagnostic, why: str) -> AdmitReply:
        """An invalid request's refusal, logged (its text escaped: a schema is the client's)."""
        index = self._state.spec.index
        log.warning("stage %d: refusing %s: %s", index, escape(command.seq), escape(why))
        return _refusal(command, problem, why)

    async def _constraint(self, sampling: _Sampling) -> Constraint:
        """The sequence's matcher, compiled (or copied from the cache) and advanced over its
        replay; the wait past the tokenizer is bounded by the compile limit."""
        grammars = self.grammars
        assert sampling.grammar is not None
        tokenizer = await _done(grammars.ready(sampling.vocab))  # once per stage: no limit
        try:
            async with asyncio.timeout(grammars.limit_s):
                compiled = grammars.compiled(sampling.grammar, tokenizer, sampling.vocab)
                return await _done(grammars.instance(await _done(compiled), sampling.replay))
        except TimeoutError:
            raise GrammarTooSlow(grammars.too_slow) from None

    def _adapter_refused(self, command: Admit) -> AdmissionDiagnostic | None:
        """A request for an adapter this stage does not hold is refused, alone."""
        if command.adapter is None:
            return None
        adapters = self._state.layers().stage.adapters
        if adapters is None or command.adapter not in adapters.named:
            log.warning(
                "stage %d: refusing %s: adapter %s is not loaded here",
                self._state.spec.index, escape(command.seq), escape(command.adapter),
            )  # fmt: skip
            return self._state.kv.refusal(RejectReason.INVALID_REQUEST)
        return None

    def _closed_reason(self, command: Admit) -> AdmissionDiagnostic | None:
        s = self._state
        if s.spec.is_standby:
            return s.kv.refusal(RejectReason.PLAN_MISMATCH)
        if not s.admitting:
            return s.kv.refusal(RejectReason.DRAINING)
        if command.plan is not None and not s.spec.matches(command.plan):
            return s.kv.refusal(RejectReason.PLAN_MISMATCH)
        return None

    def _sampling(self, command: Admit, payload: Any) -> _Sampling | None:
        """The last stage makes the sequence's sampler here (dry run included), so parameters
        it cannot serve refuse this one request instead of failing later on the mlx thread.
        ``payload``: its ``SamplerSpec`` (JSON), when the request has one. None on the other
        stages."""
        s = self._state
        if not s.spec.has_lm_head:
            return None
        spec = parse_sampler_spec(bytes(payload.data)) if payload is not None else None
        draw = make_sampler(
            command.temperature, command.top_p, command.seed, command.first_draw,
            top_k=spec.top_k if spec else 0, min_p=spec.min_p if spec else 0.0,
        )  # fmt: skip
        vocab = None
        if spec is not None and (spec.logit_bias or spec.grammar):
            size = s.layers().stage.config.get("vocab_size")
            vocab = size if isinstance(size, int) else None
        _check_replay(spec, command.first_draw)
        grammar = spec.grammar if spec is not None else None
        replay = tuple(spec.replay) if spec is not None else ()
        return _Sampling(SequenceSampler(draw, spec, vocab), grammar, vocab or 0, replay)


def _check_replay(spec: SamplerSpec | None, first_draw: int) -> None:
    """A replay is what a constrained sequence sent before: exactly ``first_draw`` tokens."""
    if spec is None or (spec.grammar is None and not spec.replay):
        return
    if spec.grammar is None:
        raise _Refused("replayed tokens came without a grammar to follow them")
    if len(spec.replay) != first_draw:
        raise _Refused(
            f"{len(spec.replay)} replayed tokens for a sequence whose next draw is number "
            f"{first_draw}; a replay carries every token sent before it"
        )


def _refusal(command: Admit, problem: AdmissionDiagnostic, detail: str | None = None) -> AdmitReply:
    return AdmitReply(rid=command.rid, ok=False, diagnostic=AdmitRefusal.of(problem, detail))


def _sentence(exc: BaseException) -> str:
    """An error as one line for the client (a pydantic error spans several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


async def _done(future: Future[T]) -> T:
    """A pool thread's result, awaited without blocking the loop; a wait given up (the
    compile limit) leaves the work to finish and be cached for the next request."""
    waited = asyncio.wrap_future(future)
    waited.add_done_callback(_retrieved)  # an error after the wait was given up is no news
    return await asyncio.shield(waited)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
