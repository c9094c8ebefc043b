"""The full sampling surface through a live 2-stage cluster (``serve --pp-size 2`` with default
flags: decode steps in auto micro-batches, one per stage), with the official ``openai``
client: ``n`` choices, ``logprobs`` with ``top_logprobs``, stop lists, and every sampling
parameter doing what mlx-lm's own sampler and logits processors do with the same settings
(checked where both are deterministic: greedy with penalties or a bias, top-k 1, min-p 1, a
tiny top-p)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.clusters import RunningCluster, start_cluster, wait_gone

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me a story about a dragon."}]
MAX_TOKENS = 8  # enough for every parameter below to change mlx-lm's greedy text


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, embedded_model_dir: Path
) -> Iterator[RunningCluster]:
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    flags = ("--pp-size", "2", "--alias", "x", "--max-choices-per-request", "5")
    running = start_cluster(tmp_path_factory.mktemp("sampling"), env, *flags)
    yield running
    assert running.stop() == 0, running.log()
    assert wait_gone(running.stage_pids) == []


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def mlx_lm_reference(embedded_model_dir: Path) -> Any:
    """``reference(sampler=..., logits_processors=...)``: single-process mlx-lm's answer."""
    from mlx_lm import generate

    from tests.support.references import load_reference

    model, tokenizer = load_reference(embedded_model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)

    def reference(**kw: Any) -> str:
        return str(generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, **kw))

    reference.tokenizer = tokenizer  # type: ignore[attr-defined]
    reference.model = model  # type: ignore[attr-defined]
    return reference


def ask(client: openai.OpenAI, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": "x", "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    return client.chat.completions.create(**{**args, **kw})


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI) -> Any:
    """The cluster's greedy answer to ``MESSAGES`` with its top logprobs (asked once, compared
    with in several tests)."""
    return ask(client, temperature=0, logprobs=True, top_logprobs=5)


def test_n_choices_come_back_independent_and_counted_once(
    client: openai.OpenAI, greedy: Any
) -> None:
    same = ask(client, temperature=0, n=3)
    assert [c.index for c in same.choices] == [0, 1, 2]
    assert {c.message.content for c in same.choices} == {greedy.choices[0].message.content}
    assert same.usage.prompt_tokens == greedy.usage.prompt_tokens  # the prompt counts once
    assert same.usage.completion_tokens == 3 * greedy.usage.completion_tokens

    sampled = ask(client, temperature=1.0, seed=11, n=3)
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1, texts  # each choice draws its own tokens
    # Choice 0 draws what a single request with the seed draws; the same seed streamed
    # (below) draws the same three again.
    assert ask(client, temperature=1.0, seed=11).choices[0].message.content == texts[0]

    stream = ask(client, temperature=1.0, seed=11, n=3, stream=True)
    assembled = ["", "", ""]
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            assembled[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert assembled == texts and finished == {0, 1, 2}


def test_top_logprobs_come_sorted_with_the_chosen_token_first_when_greedy(
    client: openai.OpenAI, greedy: Any
) -> None:
    answer = greedy
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 5
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert top[0].token == entry.token and abs(top[0].logprob - entry.logprob) < 1e-5
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, temperature=0, top_logprobs=5)  # without logprobs: OpenAI's rule
    assert "top_logprobs needs logprobs" in str(refused.value)


def test_stop_takes_a_list(client: openai.OpenAI, greedy: Any) -> None:
    full = greedy.choices[0].message.content
    words = full.split()
    cut = ask(client, temperature=0, stop=["zzz", words[2]]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[: full.index(words[2])]


def test_each_sampling_parameter_does_what_mlx_lms_does(
    client: openai.OpenAI, mlx_lm_reference: Any, greedy: Any
) -> None:
    from mlx_lm.sample_utils import make_logits_processors

    assert greedy.choices[0].message.content == mlx_lm_reference()
    greedy = greedy.choices[0].message.content
    first = mlx_lm_reference.tokenizer.encode(greedy, add_special_tokens=False)[0]
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"extra_body": {"repetition_penalty": 1.5}}, {"repetition_penalty": 1.5}),
        ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
        ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
        ({"logit_bias": {str(first): -100}}, {"logit_bias": {first: -100.0}}),
    ]
    changed = []
    for ours, theirs in cases:
        expected = mlx_lm_reference(logits_processors=make_logits_processors(**theirs))
        got = ask(client, temperature=0, **ours).choices[0].message.content
        assert got == expected, (ours, got, expected)
        changed.append(got != greedy)
    # Not vacuous: the bias removes greedy's first token, and the penalties change the text.
    assert changed[-1] and sum(changed) >= 3, changed
    # Sampling cases that keep one token: mlx-lm's sampler with them (make_sampler's top_k=1,
    # min_p=1.0, a tiny top_p) keeps only the most likely token, so it is greedy, and so is ours.
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        got = ask(client, temperature=1.0, seed=3, extra_body=extra).choices[0].message.content
        assert got == greedy, extra
    assert ask(client, temperature=1.0, seed=3, top_p=1e-6).choices[0].message.content == greedy


def test_a_chats_next_turns_reuse_the_kept_prefix_and_answer_the_same(
    client: openai.OpenAI, mlx_lm_reference: Any
) -> None:
    from mlx_lm import generate

    model, tokenizer = mlx_lm_reference.model, mlx_lm_reference.tokenizer
    messages: list[dict[str, str]] = []
    cached = []
    for question in ("Describe a quiet forest at dawn.", "Make it shorter.", "Give it a title."):
        messages.append({"role": "user", "content": question})
        answer = ask(client, messages=messages, temperature=0)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The same text as computing the whole conversation afresh (single-process mlx-lm).
        expected = generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
        assert answer.choices[0].message.content == expected
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        assert cached[-1] < answer.usage.prompt_tokens
        messages.append({"role": "assistant", "content": expected})
    # Turns 2 and 3 start from what the turn before left on every stage (turn 1 may share
    # the chat template's system preamble with earlier requests, no more).
    assert cached[0] < cached[1] < cached[2], cached
    assert cached[1] > cached[0] + MAX_TOKENS // 2, cached


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris this week?"}]


def test_a_named_tool_choice_returns_a_call_that_fits_the_schema(client: openai.OpenAI) -> None:
    import jsonschema

    choice = {"type": "function", "function": {"name": "get_weather"}}
    # Sampled (temperature 1): the constraint, not the model's luck, makes the call fit.
    kw: dict[str, Any] = {"messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": choice,
                          "temperature": 1.0, "seed": 0, "max_tokens": 64}  # fmt: skip
    answer = ask(client, **kw)
    assert answer.choices[0].finish_reason == "tool_calls"
    (plain,) = answer.choices[0].message.tool_calls
    assert plain.function.name == "get_weather" and plain.id.startswith("call_")
    jsonschema.validate(json.loads(plain.function.arguments), WEATHER["function"]["parameters"])
    # Streamed with the same seed: the tool-call deltas assemble to the same call.
    names, arguments, finish = "", "", None
    stream = ask(client, **kw, stream=True)
    for chunk in stream:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or ():
                names += delta.function.name or ""
                arguments += delta.function.arguments or ""
            finish = c.finish_reason or finish
    assert (names, arguments, finish) == (plain.function.name, plain.function.arguments,
                                          "tool_calls")  # fmt: skip


def test_a_tool_result_goes_back_into_the_conversation(client: openai.OpenAI) -> None:
    first = ask(client, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                temperature=0, max_tokens=64).choices[0].message  # fmt: skip
    (call,) = first.tool_calls
    follow = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny, 24 C"}'},
    ]
    answer = ask(client, messages=follow, tools=[WEATHER], tool_choice="none", temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_json_schema_output_always_parses_and_validates(client: openai.OpenAI) -> None:
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "color"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]

    # Greedy, before the samples below and on a prompt of its own: their kept prompt prefixes
    # were computed in batches whose make-up depends on timing, and a greedy answer reusing
    # one could change with it (this prompt's greedy object closes after ~15 tokens).
    asked = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    answer = ask(client, messages=asked, response_format={"type": "json_object"},
                 temperature=0, max_tokens=96).choices[0]  # fmt: skip
    assert answer.finish_reason == "stop", answer
    assert isinstance(json.loads(answer.message.content), dict)

    def sample(seed: int) -> list[str]:
        answer = ask(client, messages=messages, response_format=fmt, temperature=1.0, n=5,
                     seed=seed, max_tokens=64)  # fmt: skip
        return [c.message.content for c in answer.choices]

    # 10 samples at temperature 1: two requests of five choices, at once (the stages decode
    # them in shared batches, as a loaded server does).
    with ThreadPoolExecutor(max_workers=2) as pool:
        outputs = [text for texts in pool.map(sample, range(2)) for text in texts]
    assert len(outputs) == 10
    for text in outputs:
        try:
            jsonschema.validate(json.loads(text), schema)
        except json.JSONDecodeError as exc:
            raise AssertionError(f"not JSON: {text!r}") from exc


def test_the_anthropic_client_gets_a_message_a_stream_and_a_tool_use(
    cluster: RunningCluster, greedy: Any
) -> None:
    import anthropic

    claude = anthropic.Anthropic(base_url=cluster.url, api_key="none", max_retries=0, timeout=300)
    base = {"model": "x", "max_tokens": MAX_TOKENS, "messages": MESSAGES}
    message = claude.messages.create(**base, extra_body={"temperature": 0})
    expected = greedy.choices[0].message.content
    assert message.content[0].text == expected and message.stop_reason == "max_tokens"
    with claude.messages.stream(**base, extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == expected
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip
    used = claude.messages.create(
        model="x", max_tokens=64, messages=ASK_WEATHER, tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0},
    )  # fmt: skip
    assert used.stop_reason == "tool_use"
    (block,) = [b for b in used.content if b.type == "tool_use"]
    assert block.name == "get_weather" and set(block.input) == {"city", "unit", "days"}
