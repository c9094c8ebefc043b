"""The coordinator's side of one real stage worker, driven by hand over a real channel: its
control requests and replies, plus the data messages the stage sends back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from mlxppd.core.protocol.control import Ack, Admit, AdmitReply, Configure
from mlxppd.core.protocol.pipeline import TokenMeta
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.coordinator.control_client import ControlClient
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Message, MessageKind
from tests.support.pipelines import stage_worker
from tests.support.wire import config

PROMPT = [1, 504, 3458, 282, 4649, 30, 2]  # any ids of the vocabulary


class Peer:
    """The coordinator's side of one stage: control requests, plus the data messages."""

    def __init__(self, channel: SecureChannel) -> None:
        self.channel = channel
        self.control = ControlClient(channel, timeout_s=60)
        self.data: asyncio.Queue[Message] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self.channel:
            if message.kind is MessageKind.REPLY:
                self.control.deliver(message)
            else:
                self.data.put_nowait(message)

    async def admit(self, seq: str) -> None:
        for commit in (False, True):
            command = Admit(seq=seq, prompt_tokens=len(PROMPT), max_tokens=4, commit=commit)
            assert (await self.control.ask(command, AdmitReply)).ok

    async def send(self, seq: str, step: int, tensor: Any) -> None:
        meta = {"seq": seq, "step": step, "sample": True, "logprobs": False}
        await self.channel.send(MessageKind.ACTIVATION, meta, tensor)

    async def send_group(self, group: str, seqs: list[str], step: int, tokens: list[int]) -> None:
        meta = {"group": group, "seqs": seqs, "step": step}
        tensor = np.asarray([[t] for t in tokens], dtype=np.int32)
        await self.channel.send(MessageKind.ACTIVATION, meta, tensor)

    async def prefill(self, seq: str) -> int:
        """Prefill ``PROMPT`` for ``seq``: the token the stage samples."""
        await self.send(seq, 0, np.asarray([PROMPT], dtype=np.int32))
        message = await self.data.get()
        assert message.kind is MessageKind.TOKENS, message.meta
        assert TokenMeta.model_validate(dict(message.meta)).seq == seq
        return int(np.frombuffer(message.tensor.data, dtype=np.int32)[0])

    async def greedy(self, seq: str, steps: int) -> list[int]:
        """Prefill ``PROMPT``, then decode: the tokens the stage samples for ``seq``."""
        tokens: list[int] = []
        await self.send(seq, 0, np.asarray([PROMPT], dtype=np.int32))
        for step in range(steps):
            message = await self.data.get()
            assert message.kind is MessageKind.TOKENS, message.meta
            assert TokenMeta.model_validate(dict(message.meta)).seq == seq
            tokens.append(int(np.frombuffer(message.tensor.data, dtype=np.int32)[0]))
            if step + 1 < steps:
                await self.send(seq, step + 1, np.asarray([[tokens[-1]]], dtype=np.int32))
        return tokens

    async def close(self) -> None:
        await self.channel.close()
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


async def connect(worker: StageWorker) -> Peer:
    """A coordinator's channel to a started worker, configured (the last stage: no next hop)."""
    assert worker.address is not None
    host, port = worker.address
    channel = await create_transport("tcp", config("coordinator")).connect(
        host, port, expected_peer="stage-0"
    )
    peer = Peer(channel)
    assert (await peer.control.ask(Configure(), Ack)).ok
    return peer


async def connected(model: Path, mlx: MlxThread, num_layers: int) -> tuple[StageWorker, Peer]:
    """One stage worker serving every layer of ``model``, and a coordinator's peer on it."""
    worker = await stage_worker(model, mlx, StageSpec(0, 1, 0, num_layers))
    await worker.start("127.0.0.1", 0)
    return worker, await connect(worker)
