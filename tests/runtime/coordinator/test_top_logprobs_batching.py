"""Requests reporting top logprobs decode inside micro-batches like the others: the last stage
answers each member of a batched step with its own token, logprob and most likely tokens, so
such a request costs a row of a pass, not a pass of its own, and gets exactly what it gets
alone. On the embedded model: a live 2-stage cluster (``serve --pp-size 2``, default flags:
auto micro-batches, one per stage) through the chat API; and real stage workers in this
process for a group whose answer is too large for one message (it comes back in parts)."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxppd.core.protocol.pipeline import BatchTokenMeta
from mlxppd.core.protocol.sampling import MAX_TOP_LOGPROBS
from mlxppd.core.stages import StageSpec
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer
from mlxppd.runtime.backends.contract import SamplingParams, TokenEvent
from mlxppd.runtime.observability.trace import now_us
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.codec import metadata_bytes
from mlxppd.wire.limits import FrameLimits
from tests.support.clusters import RunningCluster, start_cluster, wait_gone
from tests.support.pipelines import pipeline, stage_worker
from tests.support.wire import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 12
TOP = 5
#: (question, sampling) of the requests reporting their top logprobs: greedy and seeded
REPORTING: list[tuple[str, dict[str, Any]]] = [
    ("Tell me a story about a dragon.", {"temperature": 0}),
    ("Name three colours of the rainbow.", {"temperature": 0}),
    ("Write a short poem about the sea.", {"temperature": 0.8, "seed": 7}),
    ("What is the capital of France? Explain.", {"temperature": 0.8, "seed": 1234}),
]
#: requests that report nothing, decoding beside them
PLAIN = ["Count from one to ten.", "Describe a cat in two sentences."]
#: what each stage logs as it stops: its forward passes, and how many rows its batched ones had
PASSES = re.compile(r"stage (\d): \d+ forward passes, (\d+) of them micro-batches of ([\d.]+)")


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, embedded_model_dir: Path
) -> Iterator[RunningCluster]:
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    flags = ("--pp-size", "2", "--alias", "x")
    running = start_cluster(tmp_path_factory.mktemp("top-logprobs"), env, *flags)
    yield running
    assert running.stop() == 0, running.log()
    assert wait_gone(running.stage_pids) == []


def ask(url: str, question: str, sampling: dict[str, Any]) -> dict[str, Any]:
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        **sampling,
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def assert_same_answer(got: dict[str, Any], alone: dict[str, Any]) -> None:
    """The same text, and per token the same token, logprob and most likely tokens (the same
    ones in the same order; logprobs to float32 rounding of a batched pass)."""
    choice, expected = got["choices"][0], alone["choices"][0]
    assert choice["message"]["content"] == expected["message"]["content"]
    assert choice["finish_reason"] == expected["finish_reason"]
    steps = (choice["logprobs"] or {}).get("content") or []
    wanted = (expected["logprobs"] or {}).get("content") or []
    assert len(steps) == len(wanted)
    for step, want in zip(steps, wanted, strict=True):
        assert (step["token"], step["bytes"]) == (want["token"], want["bytes"])
        assert step["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
        top, want_top = step["top_logprobs"], want["top_logprobs"]
        assert [(t["token"], t["bytes"]) for t in top] == [
            (t["token"], t["bytes"]) for t in want_top
        ]
        assert [t["logprob"] for t in top] == pytest.approx(
            [t["logprob"] for t in want_top], abs=1e-4
        )


def test_requests_reporting_top_logprobs_share_micro_batches_and_answer_as_alone(
    cluster: RunningCluster,
) -> None:
    """The one test of the module's cluster: it stops it at the end, for the stages' pass
    counts (each stage logs them as it stops)."""
    reporting = {"logprobs": True, "top_logprobs": TOP}
    requests = [(q, {**sampling, **reporting}) for q, sampling in REPORTING]
    requests += [(q, {"temperature": 0}) for q in PLAIN]

    # One at a time: each decode pass carries one row.
    alone = [ask(cluster.url, q, sampling) for q, sampling in requests]
    for answer in alone[: len(REPORTING)]:
        steps = answer["choices"][0]["logprobs"]["content"]
        assert steps and all(len(s["top_logprobs"]) == TOP for s in steps)
    # All at once: they decode in the same micro-batches.
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: ask(cluster.url, *r), requests))

    for got, expected in zip(together, alone, strict=True):
        assert_same_answer(got, expected)
    assert cluster.stop() == 0, cluster.log()
    stats = PASSES.findall(cluster.log())
    assert sorted(stage for stage, _, _ in stats) == ["0", "1"], cluster.log()[-2000:]
    for _stage, passes, mean_rows in stats:
        # Rows beyond one a pass: only passes shared by several requests have any. The two
        # plain requests alone would each start a group of their own (one per stage): these
        # are the reporting requests' rows, at least one request's worth of steps.
        extra_rows = round(float(mean_rows) * int(passes)) - int(passes)
        assert extra_rows >= MAX_TOKENS, stats


MEMBERS = 12
PART_TOKENS = 5


def test_a_step_whose_answer_is_too_large_for_one_message_comes_back_in_parts(
    embedded_model_dir: Path, tmp_path: Path
) -> None:
    """12 members each reporting the most top logprobs a request may ask for: the answer to a
    batched step of many of them is larger than a message's metadata limit; each member still
    gets exactly its own tokens, logprobs and top logprobs, those it gets alone."""
    tokenizer = load_tokenizer(embedded_model_dir)
    prompts = [
        encode_prompt(tokenizer, f"Tell me fact number {i + 1} about owls.", chat_template=True)
        for i in range(MEMBERS)
    ]
    params = [
        SamplingParams(
            max_tokens=PART_TOKENS,
            logprobs=True,
            top_logprobs=MAX_TOP_LOGPROBS,
            temperature=0.8 if i % 2 else 0.0,
            seed=i,
        )
        for i in range(MEMBERS)
    ]
    trace = tmp_path / "trace.json"

    async def scenario() -> tuple[list[list[TokenEvent]], list[list[TokenEvent]], float]:
        mlx = MlxThread("top-logprobs-mlx")
        split = (StageSpec(0, 2, 0, 17), StageSpec(1, 2, 17, 30))
        workers = [
            await stage_worker(embedded_model_dir, mlx, spec, sequences=MEMBERS) for spec in split
        ]
        setup: dict[str, Any] = {
            "micro_batch_size": MEMBERS, "parallel": MEMBERS, "prompt_cache": 0,
            "trace_path": trace,
        }  # fmt: skip
        async with pipeline(workers, mlx, **setup) as coordinator:

            async def events(name: str, i: int) -> list[TokenEvent]:
                return [e async for e in coordinator.generate(name, prompts[i], params[i])]

            alone = [await events(f"alone{i}", i) for i in range(MEMBERS)]
            started = now_us()
            together = await asyncio.gather(*(events(f"t{i}", i) for i in range(MEMBERS)))
            assert await coordinator.flush_trace()
        return alone, list(together), started

    alone, together, started = run(scenario)

    for got, expected in zip(together, alone, strict=True):
        assert [e.token for e in got] == [e.token for e in expected]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in expected], abs=1e-4)
        for step, want in zip(got, expected, strict=True):
            assert step.top is not None and want.top is not None
            assert [t for t, _ in step.top] == [t for t, _ in want.top]
            assert [v for _, v in step.top] == pytest.approx([v for _, v in want.top], abs=1e-4)
    # The last stage's passes while they ran together (its trace): the largest carried many
    # members, and the answer to that many members does not fit one message.
    passes = [
        e["args"]["rows"]
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("pid") == "stage-1" and e["name"] == "stage" and e["ts"] >= started
    ]
    most = max(passes)
    answer = BatchTokenMeta(
        group="g0",
        seqs=[f"t{i}.{i}" for i in range(most)],
        step=1,
        logprobs=[events[1].logprob for events in together[:most]],
        tops=[list(events[1].top or ()) for events in together[:most]],
    )
    assert metadata_bytes(answer.model_dump()) > FrameLimits().max_metadata_bytes, passes
