"""The coordinator's measure of its pipeline's speed, which sizes prefill chunks
(``core/prefill_chunks.py``).

Two figures: seconds per prompt token for a prompt prefilled with nothing else running, and
seconds between two tokens of a stream while no prompt is being prefilled. A step that waited
on a prefill chunk is not a decode step's cost: counting it would grow the chunks, which would
grow the next wait, so only steps that began after every prefill's first token count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mlxppd.core.prefill_chunks import PipelineSpeed, prefill_chunk_size

log = logging.getLogger("mlxppd.coordinator")


class SpeedMeter:
    def __init__(self, stages: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.speed = PipelineSpeed()
        self._stages = stages
        self._clock = clock
        #: sequence -> (prefill start, prompt tokens computed) until its first token
        self._prefilling: dict[str, tuple[float, int]] = {}
        #: prefills that shared the pipeline with other work (not timed)
        self._shared: set[str] = set()
        #: each decoding sequence's last token time
        self._last: dict[str, float] = {}
        #: when the last prefill in flight got its first token
        self._quiet_since = 0.0

    def prefill_began(self, seq: str, tokens: int, others_running: bool) -> None:
        """``seq`` starts computing ``tokens`` prompt tokens."""
        if others_running or self._prefilling:
            self._shared.update((seq, *self._prefilling))
        self._prefilling[seq] = (self._clock(), tokens)

    def token(self, seq: str) -> None:
        """A token of ``seq`` arrived."""
        now = self._clock()
        known = self.speed.pass_rows(self._stages) is not None
        self._measure(seq, now)
        self._last[seq] = now
        rows = self.speed.pass_rows(self._stages)
        if not known and rows is not None:
            log.info(
                "coordinator: measured %.2f ms per prompt token and %.1f ms per decode step:"
                " prefill chunks of %d tokens while others decode",
                1e3 * self.speed.prefill_s_per_token, 1e3 * self.speed.decode_step_s,
                prefill_chunk_size(0, self._stages, True, speed=self.speed),
            )  # fmt: skip

    def _measure(self, seq: str, now: float) -> None:
        began = self._prefilling.pop(seq, None)
        if began is not None:
            if seq not in self._shared:
                self.speed = self.speed.prefilled(began[1], now - began[0])
            self._shared.discard(seq)
            if not self._prefilling:
                self._quiet_since = now
        else:
            self._shared.update(self._prefilling)  # they share the pipeline with this step
            last = self._last.get(seq)
            if last is not None and not self._prefilling and last >= self._quiet_since:
                self.speed = self.speed.stepped(now - last)

    def ended(self, seq: str) -> None:
        """``seq`` finished or failed (its prefill may never have completed)."""
        self._last.pop(seq, None)
        self._shared.discard(seq)
        if self._prefilling.pop(seq, None) is not None and not self._prefilling:
            self._quiet_since = self._clock()
