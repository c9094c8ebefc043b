"""Sending a sequence's input into stage 0: the prompt (in chunks; copied from a kept prefix
or from the leading choice's head where it can be), then each decode step. A mixin of
``Coordinator`` (``coordinator.py``), which owns the links."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mlxppd.core.prefill_chunks import prefill_chunk_size
from mlxppd.core.prompt_cache import Reuse
from mlxppd.runtime.backends.contract import SamplingParams
from mlxppd.runtime.coordinator.shared_prefill import SharedPrefill
from mlxppd.runtime.coordinator.speed_meter import SpeedMeter
from mlxppd.runtime.coordinator.stage_link import StageLink
from mlxppd.runtime.observability.trace import TraceBuffer
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import ChannelClosedError


class PromptSender:
    """What the coordinator sends into the pipeline (mixed into ``Coordinator``)."""

    _links: list[StageLink]
    #: --prefill-chunk-size (None: chosen per prompt, core/prefill_chunks.py)
    prefill_chunk: int | None = None
    #: the pipeline's measured prefill and decode speed, which sizes the chunks
    meter: SpeedMeter
    active: int
    trace: TraceBuffer

    if TYPE_CHECKING:  # provided by Coordinator: how a link's failure is handled

        def _fail(self, link: StageLink, reason: str) -> None: ...

        def _lost(self, reason: str) -> Exception: ...

    async def _prefill(
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
            others = self.active > 1
            self.meter.prefill_began(seq, len(head) + 1, others)
            size = prefill_chunk_size(
                len(head), len(self._links), others, self.prefill_chunk, self.meter.speed
            )
            rows = self.meter.speed.pass_rows(len(self._links))
            self.trace.instant(
                "prefill_chunks", 0, seq=seq, tokens=len(head), size=size, pass_rows=rows
            )
            try:
                for i in range(0, len(head), size):
                    final = i + size >= len(head)
                    chunk = head[i : i + size]
                    await self._send_input(
                        seq, step, chunk, False, False, forks if final else None, cached
                    )
                    step, cached = step + 1, None
            finally:
                if share is not None:
                    share.head_done(seq if step else None)
        await self._send_input(seq, step, last, True, params.logprobs, cached=cached)
        return step

    async def _send_input(
        self, seq: str, step: int, tokens: list[int], sample: bool, logprobs: bool,
        forks: list[str] | None = None, cached: tuple[str, int] | None = None,
    ) -> None:  # fmt: skip
        link = self._links[0]
        array = np.asarray([tokens], dtype=np.int32)
        meta: dict[str, Any] = {"seq": seq, "step": step, "sample": sample, "logprobs": logprobs}
        if forks:
            meta["forks"] = forks
        if cached is not None:
            meta["cached"] = cached
        try:
            await link.channel.send(MessageKind.ACTIVATION, meta, array)
        except ChannelClosedError as exc:
            self._fail(link, f"stage {link.node.id} is unreachable: {exc}")
            raise self._lost(str(exc)) from None

    async def _send_group(
        self, group: str, seqs: list[str], step: int, tokens: np.ndarray, logprobs: bool,
        alone: bool = False,
    ) -> None:  # fmt: skip
        link = self._links[0]
        meta = {"group": group, "seqs": seqs, "step": step, "sample": True, "logprobs": logprobs}
        if alone and self.active == len(seqs):
            # Nothing else in the pipeline: one stage computes at a time, so each may use
            # every core its host lends to solo passes (stage_threads.py).
            meta["solo"] = True
        try:
            await link.channel.send(MessageKind.ACTIVATION, meta, tokens)
        except ChannelClosedError as exc:
            self._fail(link, f"stage {link.node.id} is unreachable: {exc}")
            raise self._lost(str(exc)) from None
