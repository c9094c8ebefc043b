"""A prompt's choices start together; when one is refused, the others are stopped first, so
the request fails with that refusal (a 503 with Retry-After for a full stage) and every choice
can still be closed, which frees its KV (found by five concurrent n=10 requests hitting a
stage's sequence cap: the request answered 500, "aclose(): asynchronous generator is already
running")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mlxppd.engine.tokenizer import load_tokenizer
from mlxppd.http.completion import Generation, start_all
from mlxppd.runtime.backends.contract import TokenEvent


class Refused(Exception):
    pass


def test_a_refused_choice_stops_its_siblings_and_every_choice_closes(
    embedded_model_dir: Path,
) -> None:
    tokenizer = load_tokenizer(embedded_model_dir)
    closed: list[str] = []

    async def waiting() -> AsyncIterator[TokenEvent]:
        try:
            await asyncio.Event().wait()  # admitted later, if ever
            yield TokenEvent(token=1)
        finally:
            closed.append("waiting")

    async def refused() -> AsyncIterator[TokenEvent]:
        await asyncio.sleep(0)
        raise Refused("stage 0 already holds 64 sequences, its limit; retry shortly")
        yield TokenEvent(token=1)  # an async generator

    async def scenario() -> None:
        gens = [Generation(waiting(), tokenizer, 3), Generation(refused(), tokenizer, 3)]
        with pytest.raises(Refused):
            await start_all(gens)
        for gen in gens:
            await gen.close()

    asyncio.run(scenario())
    assert closed == ["waiting"]
