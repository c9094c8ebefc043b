"""Per-request adapters on a stage (docs/adapters.md): ``AdapterLoad`` reads one on the mlx
thread, between forward passes, and ``AdapterUnload`` drops it; each answers when done, while
the channel keeps answering other commands. A part of ``StageWorker`` over the shared
``StageState``; it asks the layer moves whether new layers are being loaded.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from mlxppd.core.log_text import escape
from mlxppd.core.protocol.adapters import AdapterLoad, AdapterReply, AdapterUnload
from mlxppd.core.protocol.control import clip
from mlxppd.engine.tp_mirror import MirroredRunner
from mlxppd.runtime.stage.layer_moves import LayerMoves
from mlxppd.runtime.stage.state import StageState, send_reply
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Tensor

log = logging.getLogger("mlxppd.stage")


class StageAdapters:
    """AdapterLoad and AdapterUnload on a stage."""

    def __init__(self, state: StageState, moves: LayerMoves) -> None:
        self._state = state
        self._moves = moves

    async def on_adapter(
        self, channel: SecureChannel, command: AdapterLoad | AdapterUnload, tensor: Tensor | None
    ) -> None:
        # Reading an adapter takes a while; the channel keeps answering meanwhile.
        self._state.side_tasks.spawn(self._adapter_command(channel, command), name="stage-adapter")

    async def _adapter_command(
        self, channel: SecureChannel, command: AdapterLoad | AdapterUnload
    ) -> None:
        """Load or drop a per-request adapter on the mlx thread, between forward passes."""
        s = self._state
        reply = AdapterReply(rid=command.rid)
        try:
            adapters = s.layers().stage.adapters
            if adapters is None or isinstance(s.runner, MirroredRunner):
                raise ValueError("adapters run on stages of one rank")
            if self._moves.moving or not s.admitting:
                # New layers being loaded copy the adapters held when they started.
                raise ValueError("this stage is moving its layers; try again once it serves")
            if isinstance(command, AdapterLoad):
                load = functools.partial(adapters.load, command.name, Path(command.path))
                info = await s.mlx.run(load)
                reply = AdapterReply(
                    rid=command.rid, digest=info.digest, read=info.read, stored=info.stored,
                    modules=info.modules,
                )  # fmt: skip
                log.info(
                    "stage %d: adapter %s loaded from %s: %d modules, %d of its %d tensors read",
                    s.spec.index, escape(command.name), escape(command.path), info.modules,
                    info.read, info.stored,
                )  # fmt: skip
            else:
                await s.mlx.run(functools.partial(adapters.unload, command.name))
                log.info("stage %d: adapter %s unloaded", s.spec.index, escape(command.name))
        except Exception as exc:  # reported to the coordinator, which undoes it everywhere
            reply = AdapterReply(rid=command.rid, ok=False, error=clip(str(exc) or repr(exc)))
        await send_reply(channel, reply)
