"""A sequence's KV on a stage: admitting it (a dry run, then the commit, with the last stage's
sampler made at admission), releasing it (its caches kept as a prompt-cache entry or not) and
forgetting kept entries. The accounting changes as the command arrives; the caches go in order
on the compute loop (``compute.py``). A part of ``StageWorker`` over the shared ``StageState``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mlxppd.core.kv_admission import AdmissionDiagnostic, AdmissionRequest, RejectReason
from mlxppd.core.log_text import escape
from mlxppd.core.protocol.control import Admit, AdmitRefusal, AdmitReply, Forget, Release
from mlxppd.core.protocol.sampling import parse_sampler_spec
from mlxppd.engine.sampling import SequenceSampler, constraint_for, make_sampler
from mlxppd.runtime.stage.state import StageState, send_reply
from mlxppd.runtime.stage.work import ForgetWork, ReleaseWork
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Tensor

log = logging.getLogger("mlxppd.stage")


class StageAdmission:
    """Admit, Release and Forget on a stage."""

    def __init__(self, state: StageState, tokenizer: Callable[[], Any] | None = None) -> None:
        self._state = state
        # The last stage compiles output grammars against the tokenizer: loaded on first use.
        self._load_tokenizer = tokenizer
        self._tokenizer: Any = None

    async def on_admit(self, channel: SecureChannel, command: Admit, tensor: Tensor | None) -> None:
        await send_reply(channel, self._admit(command, tensor))

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

    def _admit(self, command: Admit, payload: Any = None) -> AdmitReply:
        """``payload``: the last stage's ``SamplerSpec`` (JSON), when the request has one."""
        s = self._state
        request = AdmissionRequest(command.seq, command.prompt_tokens, command.max_tokens)
        problem = (
            self._closed_reason(command)
            or s.kv.dry_run(request)
            or self._adapter_refused(command)
            or self._sampling_refused(command, payload)
        )
        if problem is None and command.commit:
            if command.adapter is not None:
                s.layers().set_adapter(command.seq, command.adapter)
            s.kv.commit(request)
            s.clock.set_active(len(s.kv.reserved), time.monotonic())
        if problem is None:
            return AdmitReply(rid=command.rid, ok=True)
        return AdmitReply(rid=command.rid, ok=False, diagnostic=AdmitRefusal.of(problem))

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

    def _grammar_tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self._load_tokenizer is None:
                raise ValueError("this stage has no tokenizer to constrain output with")
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _closed_reason(self, command: Admit) -> AdmissionDiagnostic | None:
        s = self._state
        if s.spec.is_standby:
            return s.kv.refusal(RejectReason.PLAN_MISMATCH)
        if not s.admitting:
            return s.kv.refusal(RejectReason.DRAINING)
        if command.plan is not None and not s.spec.matches(command.plan):
            return s.kv.refusal(RejectReason.PLAN_MISMATCH)
        return None

    def _sampling_refused(self, command: Admit, payload: Any) -> AdmissionDiagnostic | None:
        """The last stage makes the sequence's sampler here (dry run included), so parameters
        it cannot serve refuse this one request instead of failing later on the mlx thread."""
        s = self._state
        if not s.spec.has_lm_head:
            return None
        try:
            spec = parse_sampler_spec(bytes(payload.data)) if payload is not None else None
            draw = make_sampler(
                command.temperature, command.top_p, command.seed, command.first_draw,
                top_k=spec.top_k if spec else 0, min_p=spec.min_p if spec else 0.0,
            )  # fmt: skip
            vocab = None
            if spec is not None and (spec.logit_bias or spec.grammar):
                size = s.layers().stage.config.get("vocab_size")
                vocab = size if isinstance(size, int) else None
            constraint = None
            # The grammar compiles once, at the commit (a schema it refuses refuses there).
            if spec is not None and spec.grammar is not None and command.commit:
                constraint = constraint_for(spec.grammar, self._grammar_tokenizer(), vocab or 0)
            sampler = SequenceSampler(draw, spec, vocab, constraint)
        except Exception as exc:
            log.warning("stage %d: refusing %s: %s", s.spec.index, escape(command.seq), exc)
            return s.kv.refusal(RejectReason.INVALID_REQUEST)
        if command.commit:
            s.layers().set_sampler(command.seq, sampler)
        return None
