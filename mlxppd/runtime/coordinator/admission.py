"""Coordinated KV admission and the prompt index: a dry run on every stage, then the commit;
the release of a finished sequence (kept as a prompt-cache entry where it can be).

A stage's full KV budget first evicts kept prompt prefixes (least recently used first), then
refuses; a refusal names the stage, the reason and the bytes (``core/kv_admission.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from mlxppd.core.kv_admission import AdmissionDiagnostic, RejectReason
from mlxppd.core.prompt_cache import PromptIndex, Reuse
from mlxppd.core.protocol.control import Admit, AdmitReply, Forget, Release
from mlxppd.core.protocol.sampling import MAX_REPLAY_TOKENS, SamplerSpec
from mlxppd.runtime.backends.contract import (
    AdmissionClosed,
    AdmissionRejected,
    RequestRefused,
    SamplingParams,
)
from mlxppd.runtime.coordinator.chain import StageChain
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.trace import TraceBuffer

log = logging.getLogger("mlxppd.coordinator")


class SequenceAdmission:
    """Admits and releases sequences on every stage of ``chain()`` (the one serving now)."""

    def __init__(
        self,
        chain: Callable[[], StageChain],
        prompts: PromptIndex | None,
        metrics: PipelineMetrics | None,
        trace: TraceBuffer,
    ) -> None:
        self._chain = chain
        #: the prompt prefixes every stage keeps (None or capacity 0: none kept)
        self.prompts = prompts
        self._metrics = metrics
        self._trace = trace

    def match(self, prompt: list[int], tag: str) -> Reuse | None:
        """The longest kept prefix of ``prompt`` (of the same adapter ``tag``), if any."""
        return self.prompts.match(prompt, tag) if self.prompts is not None else None

    async def admit(
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
                await self.forget([oldest])

    async def _admit_once(
        self, seq: str, prompt: list[int], params: SamplingParams, first_draw: int
    ) -> None:
        chain = self._chain()
        spec = _with_replay(params.sampler_spec(prompt), prompt, first_draw)
        # The sampler's extras go to the last stage only, as a JSON payload.
        sampler = np.frombuffer(spec.model_dump_json().encode(), np.uint8) if spec else None
        payloads = [None] * (len(chain.links) - 1) + [sampler]
        for commit in (False, True):
            command = Admit(
                seq=seq, prompt_tokens=len(prompt), max_tokens=params.max_tokens, commit=commit,
                temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                plan=chain.plan, first_draw=first_draw, adapter=params.adapter,
            )  # fmt: skip
            replies = await chain.ask_each(command, AdmitReply, payloads=payloads)
            refused = [(d, r) for i, r in enumerate(replies) if (d := r.refusal(i)) is not None]
            if refused:
                if commit:  # another request took the room between dry run and commit
                    await self.release(seq)
                diagnostic, reply = refused[0]
                self._rejected(seq, diagnostic)
                if diagnostic.reason in (RejectReason.DRAINING, RejectReason.PLAN_MISMATCH):
                    raise AdmissionClosed(diagnostic.message())
                if diagnostic.reason is RejectReason.INVALID_REQUEST:
                    # The stage's sentence says what it could not serve (a schema too slow to
                    # compile, a bias outside the vocabulary) and what to change.
                    detail = reply.diagnostic.detail if reply.diagnostic else None
                    message = diagnostic.message()
                    raise RequestRefused(f"{message}: {detail}" if detail else message)
                raise AdmissionRejected(diagnostic)

    def _rejected(self, seq: str, d: AdmissionDiagnostic) -> None:
        """An OOM diagnostic: one log line, the counter, a trace event."""
        log.warning(
            "admission rejected: %s stage=%d%s reason=%s required=%d used=%d budget=%d active=%d",
            seq, d.stage_index, "" if d.rank is None else f" rank={d.rank}", d.reason.value,
            d.required_bytes, d.used_memory_bytes, d.budget_bytes, d.active_sequences,
        )  # fmt: skip
        if self._metrics is not None:
            self._metrics.rejections.labels(stage=str(d.stage_index), reason=d.reason.value).inc()
        self._trace.instant(
            "admission_reject", 0, seq=seq, stage=d.stage_index, rank=d.rank,
            reason=d.reason.value,
            required_bytes=d.required_bytes, available_bytes=d.available_bytes,
        )  # fmt: skip

    async def release(self, seq: str, keep: tuple[int, ...] | None = None, tag: str = "") -> None:
        """Free ``seq`` on every stage; ``keep``: the tokens its caches hold, to keep them as
        a prompt-cache entry instead (``core/prompt_cache.py``), reused only by requests of
        the same ``tag`` (the adapter: its caches hold that adapter's keys and values)."""
        command = Release(seq=seq)
        evicted: list[str] = []
        if keep and self.prompts is not None and self.prompts.capacity:
            entry = f"pc.{seq}"
            command = Release(seq=seq, keep=entry, keep_tokens=len(keep))
            evicted = self.prompts.add(entry, keep, tag)
        await self._chain().tell_each(command)
        if evicted:
            await self.forget(evicted)

    async def forget(self, entries: list[str]) -> None:
        """Every stage drops these prompt-cache entries."""
        if self.prompts is not None:
            for entry in entries:
                self.prompts.forget(entry)
        await self._chain().tell_each(Forget(entries=entries))

    async def forget_tag(self, tag: str) -> None:
        """Every stage drops the entries of adapter ``tag``."""
        if self.prompts is not None and (gone := self.prompts.forget_tag(tag)):
            await self.forget(gone)

    def clear(self) -> None:
        """A new chain: no stage holds the old chain's entries."""
        if self.prompts is not None:
            self.prompts.clear()

    async def forget_all(self) -> None:
        """Every stage drops every entry (a layer move: a stage that moved keeps none, one
        that did not would hold its entries for nobody)."""
        gone = self.prompts.clear() if self.prompts is not None else []
        for start in range(0, len(gone), 1024):  # Forget's bound per command
            await self._chain().tell_each(Forget(entries=gone[start : start + 1024]))


def _with_replay(
    spec: SamplerSpec | None, prompt: list[int], first_draw: int
) -> SamplerSpec | None:
    """A replayed constrained sequence's spec carries the tokens it sent before (the last
    ``first_draw`` of its prompt): they reach the last stage only as stage 0's prefill, and
    its grammar must follow them before the next draw."""
    if spec is None or spec.grammar is None or not first_draw:
        return spec
    if first_draw > MAX_REPLAY_TOKENS:
        raise RequestRefused(
            f"a constrained answer of {first_draw} tokens cannot be continued after a failover "
            f"(at most {MAX_REPLAY_TOKENS}); ask for fewer max_tokens"
        )
    return spec.model_copy(update={"replay": prompt[len(prompt) - first_draw :]})
