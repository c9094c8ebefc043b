"""The link from rank 0 of a tensor-parallel stage to its other ranks: only rank 0's node may
talk to a follower, a malformed call closes the link, and each call names its arguments."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from pydantic import ValidationError

from mlxppd.core.protocol.tensor_mirror import MirrorCall, MirrorOp, parse_mirror_call
from mlxppd.runtime.stage.tp_links import FollowerTrace, RankZeroInbox, follow_rank_zero
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import ChannelClosedError
from mlxppd.wire.tcp import TcpTransport
from tests.support.wire import config, run


def test_a_call_carries_only_its_own_arguments_and_bounds_them() -> None:
    call = MirrorCall(mirror=MirrorOp.KEEP, seq="s1", entry="e1", tokens=12)
    assert call.model_dump(exclude_none=True) == {
        "mirror": 4, "seq": "s1", "entry": "e1", "tokens": 12,
    }  # fmt: skip
    assert parse_mirror_call(call.model_dump(exclude_none=True)) == call
    for bad in ({"mirror": 99}, {"mirror": 1, "seq": ""}, {"mirror": 1, "shell": "rm"},
                {"mirror": 2, "seqs": []}, {"mirror": 4, "tokens": -1}):  # fmt: skip
        with pytest.raises(ValidationError):
            parse_mirror_call(bad)


def test_a_follower_takes_rank_0_only_and_a_malformed_call_closes_the_link() -> None:
    async def scenario() -> tuple[bool, int]:
        follower = TcpTransport(config("s0-r1"))
        inbox = RankZeroInbox("s0-r0")
        await inbox.listen(follower, "127.0.0.1", 0)
        assert inbox.listener is not None
        host, port = inbox.listener.address
        # Another node of the cluster (it holds the secret) is refused.
        intruder = await TcpTransport(config("s1-r0")).connect(host, port, expected_peer="s0-r1")
        with pytest.raises(ChannelClosedError):
            await asyncio.wait_for(intruder.recv(), 10)
        refused = not inbox.channel.done()
        rank_zero = await TcpTransport(config("s0-r0")).connect(host, port, expected_peer="s0-r1")
        channel = await asyncio.wait_for(inbox.channel, 10)
        await rank_zero.send(MessageKind.CONTROL, {"mirror": 1, "seq": "x", "extra": 1})
        mlx = MlxThread("test-follower")
        try:
            group = mx.distributed.init()  # a group of one: the call never reaches the ring
            calls = await follow_rank_zero(mlx, channel, None, group, FollowerTrace(0, 1))  # type: ignore[arg-type]
        finally:
            mlx.close()
        with pytest.raises(ChannelClosedError):
            await asyncio.wait_for(rank_zero.recv(), 10)
        await rank_zero.close()
        await inbox.close()
        return refused, calls

    refused, calls = run(scenario)
    assert refused and calls == 0
