"""Auto micro-batches: one group per stage, the streams spread evenly over them; a fixed size
fills the fullest group first. Each member gets its own row of the last stage's answer (its
token, logprob and top logprobs), which may come in parts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import ValidationError

from mlxppd.core.protocol.pipeline import BatchTokenMeta
from mlxppd.runtime.backends.contract import SequenceFailed, TokenEvent
from mlxppd.runtime.coordinator.micro_batcher import MicroBatcher
from mlxppd.runtime.coordinator.sequence_router import SequenceRouter
from mlxppd.wire.codec import Message, MessageKind, as_tensor


def groups_of(size: int, stages: int, streams: int) -> list[list[str]]:
    """The groups' members at their second step, once ``streams`` sequences arrived at once
    (newcomers join a group at its step boundary, as they do on a live pipeline)."""
    sent: list[tuple[str, list[str]]] = []

    async def send(
        gid: str, seqs: list[str], step: int, tokens: np.ndarray, lp: bool, alone: bool
    ) -> None:
        sent.append((gid, seqs))

    async def run() -> dict[str, list[str]]:
        batcher = MicroBatcher(size, send, stages)
        futures = {f"s{i}": batcher.submit(f"s{i}", 1, False) for i in range(streams)}
        await asyncio.sleep(0)
        first = list(sent)
        sent.clear()
        for gid, seqs in first:  # each first step's tokens come back; each member steps again
            batcher.on_tokens(gid, seqs, [2] * len(seqs), None)
            for seq in seqs:
                assert futures[seq].result().token == 2
                futures[seq] = batcher.submit(seq, 2, False)
        await asyncio.sleep(0)
        return dict(sent)

    second = asyncio.run(run())
    return sorted(second.values(), key=len, reverse=True)


def test_auto_makes_one_balanced_group_per_stage() -> None:
    assert [len(g) for g in groups_of(0, 2, 8)] == [4, 4]
    assert [len(g) for g in groups_of(0, 3, 8)] == [3, 3, 2]


def test_auto_with_fewer_streams_than_stages_runs_each_alone() -> None:
    assert [len(g) for g in groups_of(0, 4, 2)] == [1, 1]


def test_a_fixed_size_fills_groups_of_that_size() -> None:
    assert [len(g) for g in groups_of(3, 2, 8)] == [3, 3, 2]


def test_a_step_is_sent_alone_only_when_no_other_group_is_in_flight() -> None:
    flags: list[bool] = []

    async def send(
        gid: str, seqs: list[str], step: int, tokens: np.ndarray, lp: bool, alone: bool
    ) -> None:
        flags.append(alone)

    async def run() -> None:
        batcher = MicroBatcher(0, send, 2)
        first = batcher.submit("a", 1, False)
        await asyncio.sleep(0)
        second = batcher.submit("b", 1, False)  # a second group while the first is in flight
        await asyncio.sleep(0)
        first.cancel()
        second.cancel()

    asyncio.run(run())
    assert flags == [True, False]


def recorded() -> tuple[MicroBatcher, list[tuple[str, list[str]]]]:
    """A batcher of groups of 2 on one stage, and the (group, members) of each step it sends."""
    sent: list[tuple[str, list[str]]] = []

    async def send(
        gid: str, seqs: list[str], step: int, tokens: np.ndarray, lp: bool, alone: bool
    ) -> None:
        sent.append((gid, seqs))

    return MicroBatcher(2, send, 1), sent


async def both_in_flight(
    batcher: MicroBatcher, sent: list[tuple[str, list[str]]]
) -> tuple[asyncio.Future[TokenEvent], asyncio.Future[TokenEvent]]:
    """a steps alone, b joins at the next boundary: a step of [a, b] is in flight."""
    first = batcher.submit("a", 1, False)
    await asyncio.sleep(0)
    b = batcher.submit("b", 1, False)
    gid, seqs = sent[-1]
    batcher.on_tokens(gid, seqs, [4], None)
    assert first.result().token == 4
    a = batcher.submit("a", 4, False)
    await asyncio.sleep(0)
    assert sent[-1][1] == ["a", "b"]
    return a, b


def test_a_member_that_leaves_during_its_step_is_settled_when_the_step_is_answered() -> None:
    """The coordinator frees a sequence on the stages only once no step carrying it is in
    flight (the release overtook the step and failed its whole group)."""

    async def run() -> None:
        batcher, sent = recorded()
        a, b = await both_in_flight(batcher, sent)
        gid, seqs = sent[-1]
        settled = batcher.leave("b")  # b's client closed while the step is in flight
        assert not settled.done() and b.cancelled()
        batcher.on_tokens(gid, seqs, [5, 6], None)
        assert settled.done() and a.result().token == 5
        assert batcher.leave("b").done()  # gone now
        batcher.submit("a", 5, False)
        await asyncio.sleep(0)
        assert sent[-1][1] == ["a"]

    asyncio.run(run())


def test_a_member_a_stage_could_not_run_fails_alone() -> None:
    async def run() -> None:
        batcher, sent = recorded()
        a, b = await both_in_flight(batcher, sent)
        gid = sent[-1][0]
        batcher.on_tokens(gid, ["a"], [5], None)  # the answer lacks b
        assert a.result().token == 5
        assert isinstance(b.exception(), SequenceFailed)
        assert not batcher.holds("b")
        batcher.submit("a", 5, False)
        await asyncio.sleep(0)
        assert sent[-1][1] == ["a"]

    asyncio.run(run())


def test_a_member_leaving_after_the_pipeline_is_lost_is_settled_at_once() -> None:
    """Its step will never be answered: a replay must not wait for it."""

    async def run() -> None:
        batcher, sent = recorded()
        a, b = await both_in_flight(batcher, sent)
        batcher.fail(RuntimeError("the pipeline is gone"))
        assert batcher.leave("a").done() and batcher.leave("b").done()
        assert isinstance(a.exception(), RuntimeError)

    asyncio.run(run())


def routed() -> tuple[SequenceRouter, list[tuple[str, list[str]]]]:
    """A router whose batcher makes groups of 2 on one stage, and the steps it sends."""
    sent: list[tuple[str, list[str]]] = []

    async def send(
        gid: str, seqs: list[str], step: int, tokens: np.ndarray, lp: bool, alone: bool
    ) -> None:
        sent.append((gid, seqs))

    return SequenceRouter(2, send, 1), sent


def tokens_message(meta: BatchTokenMeta, tokens: list[int]) -> Message:
    """The last stage's answer as the link reader hands it on."""
    return Message(MessageKind.TOKENS, meta.model_dump(), as_tensor(np.array(tokens, np.int32)))


A_TOP = [(5, -0.1), (9, -2.5)]


def test_each_member_of_a_step_gets_its_own_top_logprobs() -> None:
    """A sequence reporting top logprobs rides in a micro-batch like the others."""

    async def run() -> None:
        router, sent = routed()
        assert router.batcher is not None
        a, b = await both_in_flight(router.batcher, sent)
        gid, seqs = sent[-1]
        answer = BatchTokenMeta(
            group=gid, seqs=seqs, step=1, logprobs=[-0.1, -0.7], tops=[A_TOP, None]
        )
        router.deliver("stage-1", tokens_message(answer, [5, 6]))
        assert a.result() == TokenEvent(token=5, logprob=-0.1, top=tuple(A_TOP))
        assert b.result() == TokenEvent(token=6, logprob=-0.7, top=None)  # it asked none

    asyncio.run(run())


def test_an_answer_in_parts_answers_the_step_with_its_last_part() -> None:
    async def run() -> None:
        router, sent = routed()
        assert router.batcher is not None
        a, b = await both_in_flight(router.batcher, sent)
        gid, seqs = sent[-1]
        first = BatchTokenMeta(group=gid, seqs=["a"], step=1, tops=[A_TOP], more=True)
        router.deliver("stage-1", tokens_message(first, [5]))
        await asyncio.sleep(0)
        assert not a.done() and not b.done()  # the step is answered once every part is in
        last = BatchTokenMeta(group=gid, seqs=["b"], step=1)
        router.deliver("stage-1", tokens_message(last, [6]))
        assert a.result() == TokenEvent(token=5, top=tuple(A_TOP))
        assert b.result() == TokenEvent(token=6)
        # The group goes on as one: its next step carries both again.
        router.batcher.submit("a", 5, False)
        router.batcher.submit("b", 6, False)
        await asyncio.sleep(0)
        assert sent[-1] == (gid, ["a", "b"])

    asyncio.run(run())


def test_an_answer_whose_rows_do_not_match_its_members_is_refused() -> None:
    """A protocol violation: the link reader that delivers it closes the stage's link."""

    async def run() -> None:
        router, sent = routed()
        assert router.batcher is not None
        a, b = await both_in_flight(router.batcher, sent)
        gid, seqs = sent[-1]
        meta = {"group": gid, "seqs": seqs, "step": 1, "tops": [A_TOP]}
        bad = Message(MessageKind.TOKENS, meta, as_tensor(np.array([5, 6], np.int32)))
        with pytest.raises(ValidationError, match="1 rows of tops for 2 members"):
            router.deliver("stage-1", bad)
        assert not a.done() and not b.done()
        a.cancel()
        b.cancel()

    asyncio.run(run())
