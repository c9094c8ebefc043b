"""One generation as text: backend tokens -> streaming detokenizer -> stop strings -> pieces.

Text that could still turn into a stop string is held back, so a stream never shows part of a
stop string; a token's logprob entry is sent with the piece that carries its text.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxppd.runtime.backends.contract import TokenEvent

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
    #: the most likely tokens (decoded) and their logprobs, when top_logprobs was asked for
    top: tuple[tuple[str, float], ...] | None = None


@dataclass
class Piece:
    text: str
    tokens: list[TokenInfo] = field(default_factory=list)


class StopMatcher:
    """Finds stop strings in a growing text, looking at each new character once.

    One Knuth-Morris-Pratt automaton per stop string: the work per token is the token's
    characters times the number of stop strings, however long the text or the stop strings.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._fallback = [_prefix_function(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: its longest prefix ending the text
        self._fed = 0
        self._longest = max((len(s) for s in self.stops), default=0)
        self.hit: int | None = None

    def feed(self, text: str) -> int | None:
        """Read the characters of ``text`` not read yet; where the earliest stop string found
        starts, or None. ``text`` must extend the text fed before."""
        if self.hit is not None or not self.stops:
            self._fed = len(text)
            return self.hit
        end = len(text)
        for i in range(self._fed, len(text)):
            if i >= end:
                break
            char = text[i]
            for k, stop in enumerate(self.stops):
                j = self._matched[k]
                while j and stop[j] != char:
                    j = self._fallback[k][j - 1]
                if stop[j] == char:
                    j += 1
                if j == len(stop):
                    start = i + 1 - j
                    self.hit = start if self.hit is None else min(self.hit, start)
                    j = self._fallback[k][j - 1]
                self._matched[k] = j
            if self.hit is not None:
                # A longer stop string that started earlier may still end in what is here.
                end = min(end, self.hit + self._longest)
        self._fed = len(text)
        return self.hit

    @property
    def holdback(self) -> int:
        """Length of the longest tail of the text fed that could still become a stop string."""
        return max(self._matched, default=0)


def _prefix_function(pattern: str) -> list[int]:
    """``out[i]``: length of the longest proper prefix of ``pattern[:i+1]`` that is also its
    suffix (where a match continues after a mismatch)."""
    out = [0] * len(pattern)
    j = 0
    for i in range(1, len(pattern)):
        while j and pattern[i] != pattern[j]:
            j = out[j - 1]
        if pattern[i] == pattern[j]:
            j += 1
        out[i] = j
    return out


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def safe_logprob(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else MIN_LOGPROB


class ContinuedText:
    """A streaming detokenizer for text that continues the prompt's last tokens (a prefill).

    A detokenizer on its own drops the leading space of its first token, which is right for a
    new turn but loses the space between a prefill and its continuation. This one reads the
    continuation after the prompt's last tokens and hands out only what follows their text, so
    the seam is spaced as in the whole text."""

    def __init__(self, tokenizer: Any, context: Sequence[int]) -> None:
        probe = tokenizer.detokenizer  # a fresh copy per access
        for token in context:
            probe.add_token(token)
        probe.finalize()
        self._cut = len(probe.text)
        self._inner = tokenizer.detokenizer
        for token in context:
            self._inner.add_token(token)

    def add_token(self, token: int) -> None:
        self._inner.add_token(token)

    def finalize(self) -> None:
        self._inner.finalize()

    @property
    def text(self) -> str:
        text: str = self._inner.text
        return text[self._cut :]


class Generation:
    """Drives ``backend.generate`` for one request and turns its tokens into text pieces."""

    def __init__(
        self,
        events: AsyncIterator[TokenEvent],
        tokenizer: Any,
        prompt_tokens: int,
        stop: Sequence[str] = (),
        is_gone: Callable[[], bool] = lambda: False,
        *,
        continues: Sequence[int] = (),
    ) -> None:
        """``events``: one choice's tokens, as the backend's ``generate`` yields them;
        ``continues``: the prompt's last tokens when the text goes on from them (a prefill)."""
        self._events = events
        self._tokenizer = tokenizer
        # mlx-lm's TokenizerWrapper hands out a fresh (reset) copy on every access.
        self._detok: Any = (
            ContinuedText(tokenizer, continues) if continues else tokenizer.detokenizer
        )
        self._eos = set(tokenizer.eos_token_ids)
        self._stop = StopMatcher(stop)
        self._is_gone = is_gone
        self._first: TokenEvent | None = None
        self._exhausted = False
        self.prompt_tokens = prompt_tokens
        #: prompt tokens the stages took from a kept prefix instead of computing them
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason = "length"
        self.text = ""

    def _top(self, event: TokenEvent) -> tuple[tuple[str, float], ...] | None:
        if event.top is None:
            return None
        decode = self._tokenizer.decode
        return tuple((decode([t]), _finite(lp)) for t, lp in event.top)

    async def start(self) -> None:
        """Wait for the first token: admission happens there, before any response byte is sent."""
        try:
            self._first = await self._events.__anext__()
        except StopAsyncIteration:
            self._exhausted = True
            return
        self.cached_tokens = self._first.cached or 0

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

    def _stopped(self, text: str, emitted: int) -> int | None:
        """Where the text ends when a stop string is in it (the generation is over), else None."""
        hit = self._stop.feed(text)
        if hit is None:
            return None
        self.finish_reason = "stop"
        self.text = text[: max(hit, emitted)]
        return max(hit, emitted)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text (the shortest of those found where it was cut),
        or None when none did."""
        start = self._stop.hit
        if start is None:
            return None
        text = self._detok.text  # the text as generated, the stop string still in it
        found = [s for s in self._stop.stops if text.startswith(s, start)]
        return min(found, key=len) if found else self._stop.stops[0]

    async def collect(self) -> list[TokenInfo]:
        """Run to the end, not streaming: every token (``text`` is then the whole text)."""
        pieces = self.pieces()
        tokens: list[TokenInfo] = []
        try:
            async for piece in pieces:
                tokens.extend(piece.tokens)
        finally:
            await pieces.aclose()
        return tokens

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
                    self._top(event),
                )
            )
            text = self._detok.text
            if (end := self._stopped(text, emitted)) is not None:
                yield take(end)
                return
            yield take(max(emitted, len(text) - self._stop.holdback))
        self._detok.finalize()
        text = self._detok.text
        if (end := self._stopped(text, emitted)) is not None:
            yield take(end)
            return
        # The generation is over: everything held back is final, including tokens whose text
        # never showed (e.g. a lone partial character).
        self.text = text
        yield Piece(text[emitted:], pending)


async def start_all(gens: Sequence[Generation]) -> None:
    """Start a prompt's choices together (they share its prefill). If one is refused, the
    others are stopped before the refusal is raised, so each can be closed (an async
    generator cannot be closed while it still waits for its first token)."""
    tasks = [asyncio.ensure_future(gen.start()) for gen in gens]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
