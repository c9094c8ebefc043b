"""An admission gate in front of a replaceable coordinator (the agent and elastic serving).

The HTTP API lives as long as the agent; the coordinator behind it is replaced when the pipeline
reconnects. The gate is where draining happens: while any reason to hold admissions is set
(``mlxppctl drain``, a reload, shutdown) new requests get 503 with Retry-After, and requests
already running finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from mlxppd.runtime.backends.contract import (
    AdmissionClosed,
    Health,
    SamplingParams,
    TokenEvent,
)
from mlxppd.runtime.coordinator.coordinator import Coordinator

#: seconds a refused client should wait: a drain or reload takes seconds, not milliseconds
DRAIN_RETRY_AFTER_S = 2


class GatedBackend:
    def __init__(self, tokenizer: Any, model_id: str) -> None:
        self._tokenizer = tokenizer
        self._model_id = model_id
        self._coordinator: Coordinator | None = None
        self._holds: dict[str, str] = {}  # why admissions are held -> sentence for clients
        self.in_flight = 0
        #: why the pipeline was refused (a stage serving another model), while it is
        self.refusal: str | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def coordinator(self) -> Coordinator | None:
        return self._coordinator

    @coordinator.setter
    def coordinator(self, coordinator: Coordinator | None) -> None:
        self._coordinator = coordinator
        if coordinator is not None:
            # A held gate (a drain, a repartition, a reload) is no time to restore a layout.
            coordinator.admission_held = lambda: bool(self._holds)

    # -- the gate ------------------------------------------------------------------------------

    def hold(self, key: str, sentence: str) -> None:
        """Stop admitting for ``key`` (several holds may overlap)."""
        self._holds[key] = sentence

    def release(self, key: str) -> None:
        self._holds.pop(key, None)

    @property
    def admission(self) -> str:
        return "draining" if self._holds else "open"

    @property
    def hold_reasons(self) -> list[str]:
        return list(self._holds)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False when ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    # -- GenerationBackend ---------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def metrics(self) -> Any:
        return self.coordinator.metrics if self.coordinator is not None else None

    def health(self) -> Health:
        if self.coordinator is None:
            return Health(
                ready=False, detail=self.refusal or "starting: the pipeline is not connected yet"
            )
        health = self.coordinator.health()
        if health.ready and self._holds:
            detail = next(iter(self._holds.values()))
            return Health(ready=False, detail=detail, stages=health.stages)
        return health

    def _open(self) -> Coordinator:
        """The coordinator, when admissions are open (AdmissionClosed otherwise)."""
        if self._holds:
            raise AdmissionClosed(next(iter(self._holds.values())), DRAIN_RETRY_AFTER_S)
        coordinator = self.coordinator
        if coordinator is None:
            why = self.refusal or "the pipeline is connecting; retry shortly"
            raise AdmissionClosed(why, DRAIN_RETRY_AFTER_S)
        return coordinator

    async def _counted(self, events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        self.in_flight += 1
        self._idle.clear()
        try:
            async for event in events:
                yield event
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        coordinator = self._open()
        async for event in self._counted(coordinator.generate(request_id, prompt, params)):
            yield event

    def generate_choices(
        self, request_id: str, prompt: list[int], params: Sequence[SamplingParams]
    ) -> list[AsyncIterator[TokenEvent]]:
        streams = self._open().generate_choices(request_id, prompt, params)
        return [self._counted(stream) for stream in streams]
