"""Sending a sequence's input into stage 0: the prompt (in chunks; copied from a kept prefix
or from the leading choice's head where it can be), then each decode step, alone or as a
micro-batch group."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mlxppd.core.prefill_chunks import prefill_chunk_size
from mlxppd.core.prompt_cache import Reuse
from mlxppd.core.protocol.pipeline import BatchForwardMeta, ForwardMeta
from mlxppd.runtime.backends.contract import SamplingParams
from mlxppd.runtime.coordinator.chain import StageChain
from mlxppd.runtime.coordinator.shared_prefill import SharedPrefill
from mlxppd.runtime.coordinator.speed_meter import SpeedMeter
from mlxppd.runtime.observability.trace import TraceBuffer
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import ChannelClosedError


class PromptSender:
    """What the coordinator sends into the pipeline of ``chain()`` (the one serving now)."""

    def __init__(
        self,
        chain: Callable[[], StageChain],
        meter: Callable[[], SpeedMeter],
        active: Callable[[], int],
        trace: TraceBuffer,
    ) -> None:
        self._chain = chain
        #: the pipeline's measured prefill and decode speed, which sizes the chunks
        self._meter = meter
        #: how many sequences run now (a prompt alone may take bigger chunks)
        self._active = active
        self._trace = trace
        #: --prefill-chunk-size (None: chosen per prompt, core/prefill_chunks.py)
        self.prefill_chunk: int | None = None

    async def prefill(
        self, seq: str, prompt: list[int], params: SamplingParams, share: SharedPrefill | None,
        reuse: Reuse | None = None,
    ) -> int:  # fmt: skip
        """Send the prompt: the head in chunks (the leader of a shared prefill names its
        followers on the last one), then the last token to sample from; a follower holds the
        leader's head already. Returns the last token's step number."""
        head, last = prompt[:-1], prompt[-1:]
        step = 0
        cached = (reuse.entry, reuse.tokens) if reuse is not None else None
        if reuse is not None:
            head = prompt[reuse.tokens : -1]  # the stages copy the rest from the entry
        if share is None or seq == share.leader_seq:
            forks = share.followers if share is not None else None
            others = self._active() > 1
            meter, stages = self._meter(), len(self._chain().links)
            meter.prefill_began(seq, len(head) + 1, others)
            size = prefill_chunk_size(len(head), stages, others, self.prefill_chunk, meter.speed)
            rows = meter.speed.pass_rows(stages)
            self._trace.instant(
                "prefill_chunks", 0, seq=seq, tokens=len(head), size=size, pass_rows=rows
            )
            try:
                for i in range(0, len(head), size):
                    final = i + size >= len(head)
                    chunk = head[i : i + size]
                    await self.send_input(
                        seq, step, chunk, False, False, forks if final else None, cached
                    )
                    step, cached = step + 1, None
            finally:
                if share is not None:
                    share.head_done(seq if step else None)
        await self.send_input(seq, step, last, True, params.logprobs, cached=cached)
        return step

    async def send_input(
        self, seq: str, step: int, tokens: list[int], sample: bool, logprobs: bool,
        forks: list[str] | None = None, cached: tuple[str, int] | None = None,
    ) -> None:  # fmt: skip
        # Built without validation (the fields are ours), once per step: the decode hot path.
        meta = ForwardMeta.model_construct(
            seq=seq, step=step, sample=sample, logprobs=logprobs, forks=forks or None,
            cached=cached,
        )  # fmt: skip
        await self._send(meta, np.asarray([tokens], dtype=np.int32))

    async def send_group(
        self, group: str, seqs: list[str], step: int, tokens: np.ndarray, logprobs: bool,
        alone: bool = False,
    ) -> None:  # fmt: skip
        # Nothing else in the pipeline: one stage computes at a time, so each may use every
        # core its host lends to solo passes (stage_threads.py).
        solo = alone and self._active() == len(seqs)
        meta = BatchForwardMeta.model_construct(
            group=group, seqs=seqs, step=step, sample=True, logprobs=logprobs, solo=solo
        )
        await self._send(meta, tokens)

    async def _send(self, meta: ForwardMeta | BatchForwardMeta, tokens: np.ndarray) -> None:
        chain = self._chain()
        link = chain.links[0]
        wire = meta.model_dump(exclude_none=True)
        try:
            await link.channel.send(MessageKind.ACTIVATION, wire, tokens)
        except ChannelClosedError as exc:
            raise chain.lost(link, f"stage {link.node.id} is unreachable: {exc}") from None
