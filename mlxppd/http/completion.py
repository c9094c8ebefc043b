"""One generation as text: backend tokens -> streaming detokenizer -> stop strings -> pieces.

Text that could still turn into a stop string is held back, so a stream never shows part of a
stop string; a token's logprob entry is sent with the piece that carries its text.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxppd.runtime.pipeline.backend import GenerationBackend, SamplingParams, TokenEvent

#: stands in for -inf, which JSON cannot carry
MIN_LOGPROB = -9999.0


class ClientGone(Exception):
    """The client closed the connection; the generation stops and frees its KV."""


@dataclass(frozen=True)
class TokenInfo:
    token: int
    #: the token decoded on its own (a partial UTF-8 character shows as U+FFFD)
    text: str
    logprob: float | None
    #: where the token's text starts in the completion text (characters)
    text_offset: int


@dataclass
class Piece:
    text: str
    tokens: list[TokenInfo] = field(default_factory=list)


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int) -> int | None:
        """Index of the earliest stop string ending after ``start``, or None."""
        if not self.stops:
            return None
        begin = max(0, start - self._longest + 1)
        hits = [i for i in (text.find(s, begin) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def holdback(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is the start of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


def safe_logprob(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else MIN_LOGPROB


class Generation:
    """Drives ``backend.generate`` for one request and turns its tokens into text pieces."""

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Any,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        stop: Sequence[str] = (),
        is_gone: Callable[[], bool] = lambda: False,
    ) -> None:
        self._events = backend.generate(request_id, prompt, params)
        self._tokenizer = tokenizer
        # mlx-lm's TokenizerWrapper hands out a fresh (reset) copy on every access.
        self._detok = tokenizer.detokenizer
        self._eos = set(tokenizer.eos_token_ids)
        self._stop = StopMatcher(stop)
        self._is_gone = is_gone
        self._first: TokenEvent | None = None
        self._exhausted = False
        self.prompt_tokens = len(prompt)
        self.completion_tokens = 0
        self.finish_reason = "length"
        self.text = ""

    async def start(self) -> None:
        """Wait for the first token: admission happens there, before any response byte is sent."""
        try:
            self._first = await self._events.__anext__()
        except StopAsyncIteration:
            self._exhausted = True

    async def close(self) -> None:
        """Close the backend's iterator, which releases the sequence's KV on every stage."""
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            await aclose()

    async def _tokens(self) -> AsyncIterator[TokenEvent]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        if self._exhausted:
            return
        async for event in self._events:
            yield event

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """Text pieces in order; ``finish_reason`` and the counts are final once this ends."""
        emitted = 0
        pending: list[TokenInfo] = []

        def take(end: int) -> Piece:
            nonlocal emitted, pending
            ready = [t for t in pending if t.text_offset < end]
            pending = [t for t in pending if t.text_offset >= end]
            piece = Piece(text[emitted:end], ready)
            emitted = max(emitted, end)
            return piece

        text = ""
        async for event in self._tokens():
            if self._is_gone():
                raise ClientGone()
            self.completion_tokens += 1
            if event.token in self._eos:
                self.finish_reason = "stop"
                break
            offset = len(self._detok.text)
            self._detok.add_token(event.token)
            pending.append(
                TokenInfo(
                    event.token,
                    self._tokenizer.decode([event.token]),
                    safe_logprob(event.logprob),
                    offset,
                )
            )
            text = self._detok.text
            hit = self._stop.find(text, emitted)
            if hit is not None:
                self.finish_reason = "stop"
                self.text = text[: max(hit, emitted)]
                yield take(max(hit, emitted))
                return
            yield take(max(emitted, len(text) - self._stop.holdback(text)))
        self._detok.finalize()
        text = self._detok.text
        hit = self._stop.find(text, emitted)
        if hit is not None:
            self.finish_reason = "stop"
            self.text = text[: max(hit, emitted)]
            yield take(max(hit, emitted))
            return
        # The generation is over: everything held back is final, including tokens whose text
        # never showed (e.g. a lone partial character).
        self.text = text
        yield Piece(text[emitted:], pending)
