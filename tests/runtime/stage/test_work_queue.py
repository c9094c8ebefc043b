"""A stage's work queue: arrival order, except that decode steps waiting when a prefill chunk
ends run before the next chunk; nothing moves past a release, nor ahead of its own prefill."""

from __future__ import annotations

import asyncio

from mlxppd.core.protocol.pipeline import BatchForwardMeta, ForwardMeta
from mlxppd.runtime.stage.work import ForwardWork, GroupWork, ReleaseWork, Work
from mlxppd.runtime.stage.work_queue import WorkQueue


def chunk(seq: str, step: int) -> ForwardWork:
    return ForwardWork(ForwardMeta(seq=seq, step=step, sample=False), None)


def last(seq: str, step: int) -> ForwardWork:
    """A sequence's last prompt token or a decode step: sampled."""
    return ForwardWork(ForwardMeta(seq=seq, step=step, sample=True), None)


def group(gid: str, step: int) -> GroupWork:
    return GroupWork(BatchForwardMeta(group=gid, seqs=["a", "b"], step=step), None)


def name(item: Work) -> str:
    if isinstance(item, GroupWork):
        return f"{item.meta.group}:{item.meta.step}"
    if isinstance(item, ForwardWork):
        return f"{item.meta.seq}:{item.meta.step}"
    return type(item).__name__


def drain(queue: WorkQueue, arrivals: dict[int, list[Work]] | None = None) -> list[str]:
    """Take every item; ``arrivals[i]``: put after the i-th take (work arriving meanwhile)."""

    async def run() -> list[str]:
        taken: list[str] = []
        while queue.qsize():
            taken.append(name(await queue.get()))
            for item in (arrivals or {}).get(len(taken), []):
                await queue.put(item)
        return taken

    return asyncio.run(run())


def test_without_prefill_the_order_is_arrival_order() -> None:
    queue = WorkQueue()
    for item in (group("g0", 0), group("g1", 0), last("x", 3), group("g0", 1)):
        queue.put_nowait(item)
    assert drain(queue) == ["g0:0", "g1:0", "x:3", "g0:1"]
    assert queue.overtakes == 0


def test_decode_steps_run_between_prefill_chunks() -> None:
    queue = WorkQueue()
    for item in (chunk("p", 0), chunk("p", 1), chunk("p", 2), last("p", 3)):
        queue.put_nowait(item)
    # Each group's next step arrives while a chunk computes.
    arrivals = {1: [group("g0", 0), group("g1", 0)], 4: [group("g0", 1)]}
    assert drain(queue, arrivals) == ["p:0", "g0:0", "g1:0", "p:1", "g0:1", "p:2", "p:3"]
    assert queue.overtakes == 3


def test_a_step_arriving_after_the_credit_waits_for_the_next_chunk() -> None:
    queue = WorkQueue()
    for item in (chunk("p", 0), chunk("p", 1), chunk("p", 2)):
        queue.put_nowait(item)
    # g0 steps again while its first step runs: it waits one chunk, so the prompt advances.
    arrivals = {1: [group("g0", 0)], 2: [group("g0", 1)], 4: [group("g0", 2)]}
    assert drain(queue, arrivals) == ["p:0", "g0:0", "p:1", "g0:1", "p:2", "g0:2"]


def test_nothing_moves_past_a_release() -> None:
    queue = WorkQueue()
    for item in (chunk("p", 0), chunk("p", 1), ReleaseWork("a"), group("g0", 0)):
        queue.put_nowait(item)
    assert drain(queue) == ["p:0", "p:1", "ReleaseWork", "g0:0"]


def test_a_sequences_last_prompt_token_never_overtakes_its_own_chunks() -> None:
    queue = WorkQueue()
    for item in (chunk("p", 0), chunk("p", 1), last("p", 2), chunk("q", 0), last("q", 1)):
        queue.put_nowait(item)
    assert drain(queue) == ["p:0", "p:1", "p:2", "q:0", "q:1"]


def test_a_choice_sharing_a_prefill_never_runs_before_the_chunk_it_copies() -> None:
    """The follower's last prompt token is sampled like a decode step, but its caches are the
    copy the leader's last chunk makes: run first, it drew from no context at all (under load
    every other choice of an ``n`` > 1 request started with a stray token)."""
    queue = WorkQueue()
    final = ForwardWork(ForwardMeta(seq="lead", step=1, sample=False, forks=["f1"]), None)
    for item in (chunk("lead", 0), final, last("f1", 0), group("g0", 0)):
        queue.put_nowait(item)
    taken = drain(queue)
    assert taken.index("lead:1") < taken.index("f1:0")
    assert taken.index("g0:0") < taken.index("lead:1")  # other decode steps still go ahead
