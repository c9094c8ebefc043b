"""The answer to a decode micro-batch step (``BatchTokenMeta``) carries each member's top
logprobs, bounded like a lone sequence's (``TokenMeta.top``), one row per member; an answer
too large for one message's metadata is cut into parts that each fit, in batch order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from mlxppd.core.protocol.pipeline import (
    MAX_MICRO_BATCH,
    BatchTokenMeta,
    TokenMeta,
    split_answer,
)
from mlxppd.core.protocol.sampling import MAX_TOP_LOGPROBS
from mlxppd.wire.codec import MessageKind, as_tensor, decode_message, encode_parts, metadata_bytes
from mlxppd.wire.limits import FrameLimits

pytestmark = pytest.mark.timeout(30)

LIMITS = FrameLimits()
#: the longest a logprob's JSON gets (17 significant digits and a three-digit exponent)
LONG_FLOAT = -1.2345678901234567e-300


def top(k: int, first: int = 0) -> list[tuple[int, float]]:
    return [(first + i, -0.5 * (i + 1)) for i in range(k)]


def answer(members: int, k: int, **extra: Any) -> BatchTokenMeta:
    """Members ``s0``..: the even ones asked ``k`` top logprobs, the odd ones none."""
    return BatchTokenMeta(
        group="g0",
        seqs=[f"s{i}" for i in range(members)],
        step=3,
        logprobs=[-0.25 * i for i in range(members)],
        tops=[top(k, 100 * i) if i % 2 == 0 else None for i in range(members)],
        **extra,
    )


def over_the_wire(meta: BatchTokenMeta, tokens: np.ndarray) -> BatchTokenMeta:
    """``meta`` as the coordinator parses it from the message the stage sends."""
    head, payload = encode_parts(MessageKind.TOKENS, meta.model_dump(), as_tensor(tokens), LIMITS)
    message = decode_message(head + bytes(payload), LIMITS)
    return BatchTokenMeta.model_validate(dict(message.meta))


def test_each_members_top_logprobs_arrive_in_its_row_and_none_where_it_asked_none() -> None:
    sent = answer(3, 5)
    got = over_the_wire(sent, np.array([7, 8, 9], dtype=np.int32))
    assert got == sent
    assert got.tops == [top(5, 0), None, top(5, 200)]
    # No member asked: no list at all, as before.
    plain = BatchTokenMeta(group="g0", seqs=["a", "b"], step=0)
    assert over_the_wire(plain, np.array([1, 2], dtype=np.int32)).tops is None


def test_a_members_top_logprobs_are_bounded_as_a_lone_sequences_are() -> None:
    # The most a request may ask, and the largest token id, are accepted.
    edge = [(0, -0.1), *top(MAX_TOP_LOGPROBS - 2, 1), ((1 << 32) - 1, LONG_FLOAT)]
    assert BatchTokenMeta(group="g", seqs=["a"], step=0, tops=[edge]).tops == [edge]
    assert TokenMeta(seq="a", step=0, top=edge).top == edge
    for row in (
        top(MAX_TOP_LOGPROBS + 1),  # more than any request may ask
        [(-1, -0.1)],  # not a token id
        [(1 << 32, -0.1)],  # beyond a token id's 32 bits
        [(1,)],  # not a (token, logprob) pair
    ):
        with pytest.raises(ValidationError):
            BatchTokenMeta(group="g", seqs=["a"], step=0, tops=[row])
        with pytest.raises(ValidationError):
            TokenMeta(seq="a", step=0, top=row)


def test_an_answer_has_exactly_one_row_of_each_list_per_member() -> None:
    seqs = ["a", "b", "c"]
    for rows in ([top(2), None], [top(2), None, None, None]):
        with pytest.raises(ValidationError, match="rows of tops for 3 members"):
            BatchTokenMeta(group="g", seqs=seqs, step=0, tops=rows)
    with pytest.raises(ValidationError, match="rows of logprobs for 3 members"):
        BatchTokenMeta(group="g", seqs=seqs, step=0, logprobs=[-0.1])
    # No more rows than a micro-batch has members, whatever the seqs say.
    with pytest.raises(ValidationError):
        BatchTokenMeta(group="g", seqs=seqs, step=0, tops=[None] * (MAX_MICRO_BATCH + 1))


def test_an_answer_that_fits_one_message_goes_whole() -> None:
    meta = answer(4, 5)
    fits = metadata_bytes(meta.model_dump()) <= LIMITS.max_metadata_bytes
    assert fits
    assert split_answer(meta, lambda m: fits) == [(meta, slice(0, 4))]


def test_an_answer_too_large_for_one_message_goes_in_parts_that_each_fit() -> None:
    members = 32  # a full group of the default 64 sequences on 2 stages
    meta = BatchTokenMeta(
        group="g0",
        seqs=[f"req-{i:020x}.0" for i in range(members)],
        step=41,
        logprobs=[LONG_FLOAT] * members,
        tops=[[(i, LONG_FLOAT) for i in range(MAX_TOP_LOGPROBS)]] * members,
    )
    tokens = np.arange(members, dtype=np.int32)
    assert metadata_bytes(meta.model_dump()) > LIMITS.max_metadata_bytes

    parts = split_answer(
        meta, lambda m: metadata_bytes(m.model_dump()) <= LIMITS.max_metadata_bytes
    )
    received = [over_the_wire(part, tokens[rows]) for part, rows in parts]  # each one encodes

    assert len(parts) > 1
    assert [p.more for p in received] == [True] * (len(parts) - 1) + [False]
    assert [seq for p in received for seq in p.seqs] == meta.seqs
    assert [lp for p in received for lp in p.logprobs or ()] == meta.logprobs
    assert [t for p in received for t in p.tops or ()] == meta.tops
    assert np.concatenate([tokens[rows] for _, rows in parts]).tolist() == tokens.tolist()
    assert {(p.group, p.step) for p in received} == {("g0", 41)}


def test_a_part_holds_top_logprobs_only_when_one_of_its_members_asked() -> None:
    meta = answer(4, 3)  # s0 and s2 asked
    parts = split_answer(meta, lambda m: len(m.seqs) == 1)
    assert [p.tops for p, _ in parts] == [[top(3, 0)], None, [top(3, 200)], None]


def test_one_members_row_always_fits_one_message() -> None:
    worst = BatchTokenMeta(
        group="g" * 64,
        seqs=["s" * 128],
        step=(1 << 63) - 1,
        logprobs=[LONG_FLOAT],
        tops=[[((1 << 32) - 1, LONG_FLOAT)] * MAX_TOP_LOGPROBS],
        more=True,
    )
    assert metadata_bytes(worst.model_dump()) < LIMITS.max_metadata_bytes // 2
