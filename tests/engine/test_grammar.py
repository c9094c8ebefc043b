"""Structured output: a grammar constraint keeps the real model's sampled output valid JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import pytest

from mlxppd.core.profile.model import read_model_config
from mlxppd.engine.grammar import MAX_SCHEMA_DEPTH, Constraint, GrammarCompiler
from mlxppd.engine.sampling import make_sampler
from mlxppd.engine.tokenizer import encode_prompt
from tests.support.references import load_reference

pytestmark = pytest.mark.slow

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "artist", "teacher", "doctor"]},
        "pets": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"kind": {"type": "string", "maxLength": 6}},
                "required": ["kind"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "role", "pets"],
    "additionalProperties": False,
}
A_PERSON = {"name": "Ada", "age": 36, "role": "engineer", "pets": [{"kind": "cat"}]}
MAX_TOKENS = 160

Reference = tuple[Any, Any, int]  # mlx-lm model, tokenizer wrapper, logits width


@pytest.fixture(scope="module")
def reference(embedded_model_dir: Path) -> Reference:
    model, tokenizer = load_reference(embedded_model_dir)
    return model, tokenizer, int(read_model_config(embedded_model_dir)["vocab_size"])


@pytest.fixture(scope="module")
def compiler(reference: Reference) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(reference[1], reference[2])


def sample_texts(reference: Reference, constraints: list[Constraint], ask: str) -> list[str]:
    """Temperature-1 completions of one prompt, sequence ``i`` drawn with seed ``i``; each row
    sampled as the last stage does it: mask, log-softmax, draw, advance. The sequences run as
    one batch (one forward pass per step for all of them) to keep the test short."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer, _ = reference
    n = len(constraints)
    draws = [make_sampler(1.0, seed=seed) for seed in range(n)]
    cache = make_prompt_cache(model)
    prompt = encode_prompt(tokenizer, ask, chat_template=True)
    logits = model(mx.array([prompt] * n), cache=cache)[:, -1, :]
    outputs: list[list[int]] = [[] for _ in range(n)]
    eos = min(tokenizer.eos_token_ids)
    live = list(range(n))
    for _ in range(MAX_TOKENS):
        rows = mx.concatenate([constraints[i].apply(logits[i : i + 1]) for i in live])
        scores = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        drawn = [draws[i](scores[j : j + 1]) for j, i in enumerate(live)]
        mx.eval(drawn)
        step = [eos] * n  # a finished sequence is fed EOS; its rows are never read again
        for i, token in zip(live, drawn, strict=True):
            step[i] = int(token.item())
            constraints[i].advance(step[i])
            if step[i] not in tokenizer.eos_token_ids:
                outputs[i].append(step[i])
        live = [i for i in live if not constraints[i].is_finished()]
        if not live:
            break
        logits = model(mx.array(step)[:, None], cache=cache)[:, -1, :]
    assert all(c.is_finished() for c in constraints), f"unfinished after {MAX_TOKENS} tokens"
    return [str(tokenizer.decode(out)) for out in outputs]


def tokens(reference: Reference, text: str) -> list[int]:
    return [int(t) for t in reference[1].encode(text, add_special_tokens=False)]


def allowed(constraint: Constraint, vocab: int) -> set[int]:
    row = constraint.apply(mx.zeros((1, vocab)))[0].tolist()
    return {i for i, v in enumerate(row) if v != float("-inf")}


def test_eight_sampled_completions_all_parse_and_validate_against_the_schema(
    reference: Reference, compiler: GrammarCompiler
) -> None:
    ask = "Describe a person as JSON: name, age, role and their pets."
    texts = sample_texts(reference, [compiler.json_schema(PERSON) for _ in range(8)], ask)
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 4  # eight draws, not one answer eight times


def test_json_object_mode_produces_a_json_object(
    reference: Reference, compiler: GrammarCompiler
) -> None:
    ask = 'Reply with a JSON object with one key, "title", naming a famous book.'
    for text in sample_texts(reference, [compiler.json_object() for _ in range(2)], ask):
        assert isinstance(json.loads(text), dict)


def test_a_complete_value_finishes_the_constraint_and_then_only_eos_is_allowed(
    reference: Reference, compiler: GrammarCompiler
) -> None:
    constraint = compiler.json_schema(PERSON)
    for token in tokens(reference, json.dumps(A_PERSON)):
        assert not constraint.is_finished()
        constraint.advance(token)
    assert constraint.is_finished()
    assert allowed(constraint, reference[2]) == set(reference[1].eos_token_ids)


def test_a_copy_follows_its_own_tokens_and_leaves_the_original_where_it_was(
    reference: Reference, compiler: GrammarCompiler
) -> None:
    original = compiler.json_schema(PERSON)
    at_start = allowed(original, reference[2])
    twin = original.copy()
    for token in tokens(reference, json.dumps(A_PERSON)):
        twin.advance(token)
    assert twin.is_finished() and not original.is_finished()
    assert allowed(original, reference[2]) == at_start
    for token in tokens(reference, json.dumps({**A_PERSON, "age": 7, "pets": []})):
        original.advance(token)
    assert original.is_finished()


def test_a_disallowed_token_is_refused_and_the_constraint_stays_usable(
    reference: Reference, compiler: GrammarCompiler
) -> None:
    constraint = compiler.json_schema(PERSON)
    with pytest.raises(ValueError, match="not allowed"):
        constraint.advance(tokens(reference, "x")[0])
    for token in tokens(reference, json.dumps(A_PERSON)):
        constraint.advance(token)
    assert constraint.is_finished()


def test_an_integer_never_leaves_its_minimum_and_maximum(
    reference: Reference, compiler: GrammarCompiler
) -> None:
    constraint = compiler.json_schema(PERSON)
    for token in tokens(reference, '{"name": "Ada", "age": 12'):
        constraint.advance(token)
    now = allowed(constraint, reference[2])
    assert tokens(reference, "0")[0] in now  # 120 is the maximum
    assert tokens(reference, "1")[0] not in now  # 121 is over it
    assert tokens(reference, ",")[0] in now  # 12 is a complete age


def test_a_top_level_number_ends_where_the_model_samples_eos(
    reference: Reference, compiler: GrammarCompiler
) -> None:
    constraint = compiler.json_schema({"type": "integer"})
    for token in tokens(reference, "12"):
        constraint.advance(token)
    assert not constraint.is_finished()  # 123 would be an integer too
    (eos,) = reference[1].eos_token_ids
    assert eos in allowed(constraint, reference[2])
    constraint.advance(eos)
    assert constraint.is_finished()


def test_a_tool_call_names_a_declared_function_with_its_own_arguments(
    reference: Reference, compiler: GrammarCompiler
) -> None:
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    time_in = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, arguments in (("get_weather", weather), ("get_time", time_in))
        ]
    }
    good = compiler.json_schema(calls)
    for token in tokens(reference, '{"name": "get_time", "arguments": {"zone": "UTC"}}'):
        good.advance(token)
    assert good.is_finished()
    wrong = compiler.json_schema(calls)
    with pytest.raises(ValueError, match="not allowed"):
        for token in tokens(reference, '{"name": "get_time", "arguments": {"city"'):
            wrong.advance(token)


def test_a_keyword_the_engine_cannot_enforce_is_refused_when_strict_and_ignored_otherwise(
    compiler: GrammarCompiler,
) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(ValueError, match="uniqueItems"):
        compiler.json_schema(schema, strict=True)
    assert not compiler.json_schema(schema, strict=False).is_finished()


def test_padded_logits_never_allow_a_padding_id(reference: Reference) -> None:
    width = reference[2] + 64  # an embedding padded past the tokenizer's vocabulary
    padded = GrammarCompiler.for_tokenizer(reference[1], width).json_object()
    assert max(allowed(padded, width)) < reference[2]


def test_the_compiler_is_built_once_per_tokenizer(
    reference: Reference, compiler: GrammarCompiler
) -> None:
    assert GrammarCompiler.for_tokenizer(reference[1], reference[2]) is compiler


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "strnig"},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
        {"type": "string", "pattern": "("},
        {"type": "integer", "minimum": 5, "maximum": 1},
    ],
    ids=["unknown type", "dangling $ref", "bad pattern", "empty range"],
)
def test_a_bad_schema_is_refused_with_one_sentence(
    compiler: GrammarCompiler, schema: dict[str, Any]
) -> None:
    with pytest.raises(ValueError) as refused:
        compiler.json_schema(schema)
    assert "\n" not in str(refused.value)


def test_a_schema_32_levels_deep_compiles_and_33_is_refused(compiler: GrammarCompiler) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        schema = {"type": "array", "items": schema}
    compiler.json_schema(schema)
    with pytest.raises(ValueError, match="deeper than 32"):
        compiler.json_schema({"type": "array", "items": schema})


def test_a_very_deep_schema_is_refused_without_recursing(compiler: GrammarCompiler) -> None:
    schema: dict[str, Any] = {}
    for _ in range(100_000):
        schema = {"items": schema}
    with pytest.raises(ValueError, match="deeper than 32"):
        compiler.json_schema(schema)


def test_a_schema_over_64_kib_is_refused(compiler: GrammarCompiler) -> None:
    names = {f"field_{i}": {"type": "string", "description": "x" * 100} for i in range(600)}
    with pytest.raises(ValueError, match="64 KiB"):
        compiler.json_schema({"type": "object", "properties": names})
