"""Rank 0 of a tensor-parallel stage and its other ranks: the link its calls travel on.

Each rank above 0 listens on its node's transport address and takes one channel, from its
stage's rank 0 (the handshake proves the cluster secret; the node id must be rank 0's). Rank 0
connects to every other rank once they have all loaded their shards, and announces each call
(``engine/tp_mirror.py``) as one CONTROL message, in call order, with the call's input tensor:
the mlx thread hands it to a sender task per rank, so rank 0 does not wait for the send before
it computes (the layers' ``all_sum`` waits for the ranks to catch up). A rank whose channel
closes is gone: rank 0's stage is broken (``on_lost``) and a follower stops following.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from pydantic import ValidationError

from mlxppd.core.config.addresses import parse_address
from mlxppd.core.log_text import escape
from mlxppd.core.protocol.tensor_mirror import MirrorCall, parse_mirror_call
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.engine.tp_mirror import apply
from mlxppd.engine.wire_tensors import from_wire, to_wire
from mlxppd.runtime.observability.trace import TraceBuffer, now_us
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind, Tensor
from mlxppd.wire.errors import ChannelClosedError, FrameError
from mlxppd.wire.tasks import TaskSet
from mlxppd.wire.transport import Listener, Transport

__all__ = ["FollowerLinks", "FollowerTrace", "RankZeroInbox", "follow_rank_zero"]

log = logging.getLogger("mlxppd.stage")

#: how long rank 0 keeps trying to reach a rank that loaded its shard (it is listening by then)
CONNECT_TIMEOUT_S = 120.0

_Item = tuple[dict[str, Any], Tensor | None, mx.array | None]


class FollowerLinks:
    """Rank 0's channels to its stage's other ranks, and the announce hook that feeds them."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        #: told once a rank is gone (the stage worker, once it exists)
        self.on_lost: Callable[[str], None] = lambda _why: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: list[asyncio.Queue[_Item | None]] = []
        self._channels: list[SecureChannel] = []
        self._tasks = TaskSet()
        self.lost = False

    async def connect(self, node_ids: tuple[str, ...], addresses: tuple[str, ...]) -> None:
        """Reach every rank above 0 (listed in rank order, rank 0 first)."""
        self._loop = asyncio.get_running_loop()
        for node, address in zip(node_ids[1:], addresses[1:], strict=True):
            host, port = parse_address(address)
            channel = await self._reach(node, host, port)
            queue: asyncio.Queue[_Item | None] = asyncio.Queue()
            self._channels.append(channel)
            self._queues.append(queue)
            self._tasks.spawn(self._send(node, channel, queue), name=f"tp-send-{node}")
            self._tasks.spawn(self._watch(node, channel), name=f"tp-watch-{node}")

    async def _reach(self, node: str, host: str, port: int) -> SecureChannel:
        deadline = asyncio.get_running_loop().time() + CONNECT_TIMEOUT_S
        while True:
            try:
                return await self.transport.connect(host, port, expected_peer=node)
            except Exception as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.info("rank 0: %s at %s:%d not reachable yet (%s)", node, host, port, exc)
                await asyncio.sleep(0.5)

    def announce(self, call: MirrorCall, x: mx.array | None) -> None:
        """Called on the mlx thread before each call: queue it for every other rank."""
        if self.lost:
            raise RuntimeError("a tensor-parallel rank of this stage is gone")
        assert self._loop is not None, "announce before connect"
        # Evaluated here, on the mlx thread; the array is kept alive until it is sent.
        tensor = to_wire(x) if x is not None else None
        item = (call.model_dump(exclude_none=True), tensor, x)
        for queue in self._queues:
            self._loop.call_soon_threadsafe(queue.put_nowait, item)

    async def _send(
        self, node: str, channel: SecureChannel, queue: asyncio.Queue[_Item | None]
    ) -> None:
        while (item := await queue.get()) is not None:
            meta, tensor, _keep = item
            try:
                await channel.send(MessageKind.CONTROL, meta, tensor)
            except (ChannelClosedError, FrameError, OSError) as exc:
                self._gone(node, f"sending failed: {exc}")
                return

    async def _watch(self, node: str, channel: SecureChannel) -> None:
        # A follower never writes: any message, or the channel closing, means it is gone.
        with contextlib.suppress(ChannelClosedError, FrameError, OSError):
            await channel.recv()
        self._gone(node, "its link closed")

    def _gone(self, node: str, why: str) -> None:
        if not self.lost:
            self.lost = True
            self.on_lost(f"tensor-parallel rank {escape(node)} is gone ({why})")

    async def close(self) -> None:
        """Close every link: each follower sees rank 0 stop."""
        self.lost = True
        for queue in self._queues:
            queue.put_nowait(None)
        for channel in self._channels:
            with contextlib.suppress(Exception):
                await channel.close()
        await self._tasks.close(ignore_errors=True)


class RankZeroInbox:
    """A follower's listener: it takes one channel, from its rank 0's node."""

    def __init__(self, rank_zero: str) -> None:
        self.rank_zero = rank_zero
        self.channel: asyncio.Future[SecureChannel] = asyncio.get_running_loop().create_future()
        self._done = asyncio.Event()
        self.listener: Listener | None = None

    async def listen(self, transport: Transport, host: str, port: int) -> None:
        self.listener = await transport.listen(host, port, self._accept)

    async def _accept(self, channel: SecureChannel) -> None:
        if channel.peer_node_id != self.rank_zero or self.channel.done():
            log.warning(
                "refusing a tensor-parallel link from %s: only %s, once",
                escape(channel.peer_node_id), escape(self.rank_zero),
            )  # fmt: skip
            await channel.close()
            return
        self.channel.set_result(channel)
        await self._done.wait()  # the channel lives while the follower reads it

    async def close(self) -> None:
        self._done.set()
        if self.listener is not None:
            await self.listener.close()


class FollowerTrace:
    """A follower's calls as trace spans, on its own track (``stage-S rank R``); rank 0
    collects them with its own when the coordinator asks for the stages' events."""

    def __init__(self, stage: int, rank: int) -> None:
        self.stage = stage
        # Recorded whether or not anyone asks: bounded, the newest calls are the ones dropped.
        self.buffer = TraceBuffer(f"stage-{stage} rank {rank}", enabled=True, max_events=20_000)

    def begin(self) -> float:
        return now_us()

    def end(self, op: str, started: float, rows: int) -> None:
        self.buffer.span("stage", self.stage, started, now_us(), rows=rows, call=op)

    def take(self) -> list[dict[str, Any]]:
        return self.buffer.take()


async def follow_rank_zero(
    mlx: MlxThread,
    channel: SecureChannel,
    runner: StageRunner,
    group: mx.distributed.Group,
    trace: FollowerTrace,
) -> int:
    """Make every call rank 0 announces, in order, until its link closes or the ring breaks;
    returns how many calls were made. A malformed message closes the link (counted in the
    transport's stats). A call that fails here failed on rank 0 too: logged, and on."""
    rank, calls = group.rank(), 0
    while True:
        try:
            message = await channel.recv()
            call = parse_mirror_call(message.meta)
        except ChannelClosedError:
            return calls
        except (FrameError, ValidationError) as exc:
            log.warning("rank %d: malformed call from rank 0, closing: %s", rank, exc)
            await channel.close()
            return calls
        tensor = message.tensor

        def run(call: MirrorCall = call, tensor: Tensor | None = tensor) -> None:
            apply(runner, call, from_wire(tensor) if tensor is not None else None, group, trace)

        try:
            await mlx.run(run)
        except RuntimeError as exc:
            if str(exc).startswith("[ring]"):
                log.warning("rank %d: the ring failed (%s); stopping", rank, exc)
                await channel.close()
                return calls
            log.warning("rank %d: %s failed as on rank 0: %s", rank, call.mirror.name, exc)
        except Exception as exc:
            log.warning("rank %d: %s failed as on rank 0: %s", rank, call.mirror.name, exc)
        calls += 1
