"""A stage's grammar pool: a schema compiles once however many sequences ask for it, a compile
over the limit is refused and remembered, and a replayed sequence's copy of the grammar has
followed the tokens it sent before, as if it had sampled them one by one."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxppd.core.profile.model import read_model_config
from mlxppd.core.protocol.sampling import GrammarSpec
from mlxppd.engine.grammar import Constraint
from mlxppd.engine.grammar_compiles import GrammarCompiles, GrammarTooSlow
from mlxppd.engine.sampling import constraint_for
from mlxppd.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(120)

PERSON = GrammarSpec(
    kind="json_schema",
    schema_text=json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        }
    ),
)
OBJECT = GrammarSpec(kind="json_object")


class Counted:
    """constraint_for, counting its calls (the pool's compile, as the stage runs it)."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, grammar: GrammarSpec, tokenizer: Any, vocab: int) -> Constraint | None:
        with self._lock:
            self.calls += 1
        return constraint_for(grammar, tokenizer, vocab)


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path) -> Any:
    return load_tokenizer(embedded_model_dir)


@pytest.fixture(scope="module")
def vocab(embedded_model_dir: Path) -> int:
    return int(read_model_config(embedded_model_dir)["vocab_size"])


@pytest.fixture()
def counted() -> Counted:
    return Counted()


@pytest.fixture()
def pool(tokenizer: Any, counted: Counted) -> Iterator[GrammarCompiles]:
    grammars = GrammarCompiles(lambda: tokenizer, compile=counted)
    yield grammars
    grammars.close()


def ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def test_sixteen_sequences_of_one_schema_compile_it_once_and_later_ones_reuse_it(
    pool: GrammarCompiles, counted: Counted, tokenizer: Any, vocab: int
) -> None:
    ready = pool.ready(vocab).result(60)
    compiled = [pool.compiled(PERSON, ready, vocab) for _ in range(16)]
    prototypes = {id(f.result(60)) for f in compiled}
    assert counted.calls == 1 and len(prototypes) == 1
    # Each sequence gets its own matcher: one advancing leaves the others where they were.
    first, second = (pool.instance(compiled[0].result()).result(60) for _ in range(2))
    first.follow(ids(tokenizer, '{"name": "Ada"'))
    assert not np.array_equal(first._allowed_row(), second._allowed_row())
    pool.compiled(PERSON, ready, vocab).result(60)  # a later request with the same schema
    assert counted.calls == 1
    pool.compiled(OBJECT, ready, vocab).result(60)  # another schema compiles on its own
    assert counted.calls == 2


def test_a_compile_over_the_limit_is_refused_naming_it_and_refused_again_without_compiling(
    tokenizer: Any, counted: Counted, vocab: int
) -> None:
    ticks = iter([0.0, 7.5])  # the compile took 7.5 s on this clock
    pool = GrammarCompiles(lambda: tokenizer, 5.0, compile=counted, clock=lambda: next(ticks))
    try:
        ready = pool.ready(vocab).result(60)
        with pytest.raises(GrammarTooSlow, match=r"grammar compile limit of 5 s"):
            pool.compiled(PERSON, ready, vocab).result(60)
        with pytest.raises(GrammarTooSlow, match=r"grammar_compile_limit_s\); simplify"):
            pool.compiled(PERSON, ready, vocab).result(60)
        assert counted.calls == 1
    finally:
        pool.close()


def test_a_replayed_copy_is_where_token_by_token_sampling_would_have_left_it(
    pool: GrammarCompiles, tokenizer: Any, vocab: int
) -> None:
    ready = pool.ready(vocab).result(60)
    compiled = pool.compiled(PERSON, ready, vocab).result(60)
    sent = ids(tokenizer, '{"name": "Ada", "age": 3')
    stepped = compiled.copy()
    for token in sent:
        stepped.advance(token)
    replayed = pool.instance(compiled, sent).result(60)
    assert np.array_equal(replayed._allowed_row(), stepped._allowed_row())
    assert not np.array_equal(replayed._allowed_row(), compiled.copy()._allowed_row())
    # The whole value replayed: only EOS may follow, as after sampling it.
    whole = pool.instance(compiled, ids(tokenizer, '{"name": "Ada", "age": 36}')).result(60)
    assert whole.is_finished()


def test_a_replay_the_grammar_does_not_allow_is_refused_naming_the_token(
    pool: GrammarCompiles, tokenizer: Any, vocab: int
) -> None:
    ready = pool.ready(vocab).result(60)
    compiled = pool.compiled(PERSON, ready, vocab).result(60)
    bad = ids(tokenizer, '{"name": "Ada", "colour"')
    with pytest.raises(ValueError, match=r"replayed token \d+ of \d+ \(id \d+\) is not allowed"):
        pool.instance(compiled, bad).result(60)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pool.instance(compiled, [vocab + 5]).result(60)


def test_a_stage_without_a_tokenizer_refuses_to_constrain(vocab: int) -> None:
    pool = GrammarCompiles(None)
    try:
        with pytest.raises(ValueError, match="no tokenizer to constrain output with"):
            pool.ready(vocab).result(60)
    finally:
        pool.close()
