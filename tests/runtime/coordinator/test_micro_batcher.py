"""Auto micro-batches: one group per stage, the streams spread evenly over them; a fixed size
fills the fullest group first."""

from __future__ import annotations

import asyncio

import numpy as np

from mlxppd.runtime.coordinator.micro_batcher import MicroBatcher


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
