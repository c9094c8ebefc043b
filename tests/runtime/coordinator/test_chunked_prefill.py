"""Chunked prefill through a real pipeline keeps the KV exact: on the embedded model, a
300-token prompt cut into the chunks the coordinator picks (alone: a few per stage; while
another stream decodes: the small chunks the measured speed gives) answers exactly as
single-process mlx-lm does with its one-pass prefill. Real stage workers on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxppd.core.prefill_chunks import prefill_chunk_size
from mlxppd.core.stages import StageSpec
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer
from mlxppd.runtime.backends.contract import SamplingParams
from mlxppd.runtime.system.mlx_thread import MlxThread
from tests.support.pipelines import pipeline, stage_worker
from tests.support.references import reference_tokens, served_weights
from tests.support.wire import run

pytestmark = pytest.mark.slow

TOKENS = 8
FACTS = [
    "Water boils at 100 degrees Celsius at sea level.", "The Moon orbits the Earth.",
    "Honey never spoils.", "Octopuses have three hearts.", "Mount Everest is in Nepal.",
    "Light from the Sun takes about eight minutes to reach us.", "Bananas are berries.",
    "The Pacific is the largest ocean.", "A year on Mars lasts 687 Earth days.",
    "Sharks existed before trees.",
]  # fmt: skip


def test_a_long_prompt_in_chunks_answers_as_mlx_lm_does(
    embedded_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = load_tokenizer(embedded_model_dir)
    facts = " ".join(f"Fact {i + 1}: {FACTS[i % len(FACTS)]}" for i in range(24))
    question = f"{facts}\nWhich of these facts is about the Moon? Answer in one sentence."
    prompt = encode_prompt(tokenizer, question, chat_template=True)
    assert len(prompt) > 256, len(prompt)  # long enough to be timed and cut into chunks
    expected = reference_tokens(
        embedded_model_dir, prompt, TOKENS, weights=served_weights(embedded_model_dir)
    )

    async def scenario() -> tuple[list[int], list[int], list[dict[str, object]]]:
        mlx = MlxThread("chunked-prefill-mlx")
        split = (StageSpec(0, 2, 0, 17), StageSpec(1, 2, 17, 30))
        workers = [await stage_worker(embedded_model_dir, mlx, spec) for spec in split]
        setup = {"micro_batch_size": 0, "prompt_cache": 0, "trace_path": tmp_path / "trace.json"}
        async with pipeline(workers, mlx, **setup) as coordinator:
            greedy = SamplingParams(max_tokens=TOKENS)

            async def tokens(params: SamplingParams) -> list[int]:
                return [e.token async for e in coordinator.generate("t", prompt, params)]

            alone = await tokens(greedy)  # alone: times prefill, then its steps time decode
            other = coordinator.generate("b", prompt[:20], SamplingParams(max_tokens=400))
            await anext(other)  # b decodes while the prompt prefills in small chunks
            shared = await tokens(greedy)
            await other.aclose()
            events = coordinator.trace.take()
        return alone, shared, [e["args"] for e in events if e["name"] == "prefill_chunks"]

    alone, shared, chunks = run(scenario)
    head = len(prompt) - 1
    sizes = [c["size"] for c in chunks if c["tokens"] == head]
    # Alone: about four chunks per stage; shared: the measured pass's worth, smaller still.
    assert sizes[0] == prefill_chunk_size(head, 2, False) and sizes[-1] < sizes[0]
    assert alone == expected
    assert shared == expected
