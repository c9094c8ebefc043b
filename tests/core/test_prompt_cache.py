"""The prompt cache: which kept prefix a prompt reuses, least recently used first out, and on
real stage workers (a tiny checkpoint, loopback, the real coordinator): a repeated prompt is
computed from the kept prefix with the same tokens, and a stage whose KV budget is full of
kept prefixes gives them up before it refuses a request."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxppd.core.prompt_cache import PromptIndex
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.backends.contract import SamplingParams
from mlxppd.runtime.stage.loader import load_stage_runner, stage_kv_manager
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport
from tests.conftest import TINY_LLAMA
from tests.support.pipelines import SPLIT, pipeline
from tests.support.wire import config, eventually, run

FIRST = list(range(3, 43))  # 40 tokens
OTHER = list(range(100, 140))
PARAMS = SamplingParams(max_tokens=6)


def test_a_prompt_reuses_the_entry_it_shares_the_longest_prefix_with() -> None:
    index = PromptIndex(capacity=2, min_reuse=3)
    assert index.add("a", [1, 2, 3, 4, 5, 6]) == []
    assert index.add("b", [1, 2, 3, 9, 9, 9]) == []
    hit = index.match([1, 2, 3, 4, 5, 7, 8])
    assert hit is not None and (hit.entry, hit.tokens) == ("a", 5)
    short = index.match([1, 2, 3, 4])
    assert short is not None and short.tokens == 3  # its last token always runs
    assert index.match([7, 7, 7, 7, 7]) is None  # nothing shared
    # "a" was used last: "b" is the least recently used, and goes first.
    assert index.add("c", [5, 5, 5, 5]) == ["b"]
    assert index.oldest() == "a" and index.clear() == ["a", "c"]


async def _worker(model: Path, mlx: MlxThread, spec: StageSpec, budget: int) -> StageWorker:
    config_ = json.loads((model / "config.json").read_text())
    runner, per_token = await load_stage_runner(mlx, model, spec, config_)
    kv = stage_kv_manager(spec, per_token, budget * per_token, 8)
    return StageWorker(
        spec, runner, kv, create_transport("tcp", config(f"stage-{spec.index}")), mlx
    )


def test_kept_prefixes_are_reused_and_given_up_for_room(tiny_model: Callable[..., Path]) -> None:
    model = tiny_model("prompt-cache-llama", TINY_LLAMA)

    async def scenario() -> dict[str, Any]:
        mlx = MlxThread("prompt-cache-mlx")
        # Room for one request (46 tokens) and a kept prefix (45), not for two of each.
        workers = [await _worker(model, mlx, spec, budget=100) for spec in SPLIT]
        async with pipeline(workers, mlx) as coordinator:

            async def ask(prompt: list[int]) -> tuple[list[int], int]:
                events = [e async for e in coordinator.generate("t", prompt, PARAMS)]
                return [e.token for e in events], events[0].cached or 0

            out: dict[str, Any] = {"first": await ask(FIRST)}
            # The release that keeps the prefix reaches the stages after the last token.
            await eventually(lambda: all(len(w.kv.pinned) == 1 for w in workers))
            out["again"] = await ask(FIRST)  # reuses the kept prefix
            await eventually(lambda: all(len(w.kv.pinned) == 2 for w in workers))
            out["other"] = await ask(OTHER)  # needs the room the kept prefixes hold
            out["kept"] = len(coordinator.prompts or ())
            return out

    out = run(scenario)
    tokens, cached = out["first"]
    assert cached == 0  # and the prefix was kept on every stage (waited for above)
    again, reused = out["again"]
    assert reused == len(FIRST) - 1 and again == tokens  # only the last token was computed
    other, _ = out["other"]
    assert len(other) == PARAMS.max_tokens  # admitted: the older prefix was given up for it
    assert out["kept"] == 2  # the repeated prompt's and the new one's: the first gave way
