"""A stage worker's model commands: what it serves (``Identify``) and receiving a prepared copy
(``PrepareCheck`` / ``PrepareData`` / ``PrepareCommit``, ``engine/prepared_copy.py``).

A mixin of ``StageWorker``. Hashing and file writes run in a thread so the channel's event loop
keeps answering; a prepare's data arrives in order on its own channel, so appends stay ordered.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import numpy as np
from pydantic import ValidationError

import mlxppd
from mlxppd.core.protocol.model_transfer import (
    IdentityReply,
    PrepareCheck,
    PrepareCommit,
    PrepareData,
    PrepareResult,
    PrepareState,
    parse_manifest,
)
from mlxppd.core.stages import StageSpec
from mlxppd.engine.families import supported_families, wire_family
from mlxppd.engine.prepared_copy import ModelReceiver
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.runtime.stage.control import ProtocolViolation, send_reply
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.version import PROTOCOL_VERSION

log = logging.getLogger("mlxppd.stage")

PrepareCommand = PrepareCheck | PrepareData | PrepareCommit


class StageModel:
    """Identity and prepare commands on a stage (mixed into ``StageWorker``)."""

    spec: StageSpec
    runner: StageRunner | None
    receiver: ModelReceiver | None
    #: why this node serves nothing (its files are missing), or None
    missing_model: str | None

    def identify(self, rid: int = 0) -> IdentityReply:
        common: dict[str, Any] = {
            "rid": rid,
            "package_version": mlxppd.__version__,
            "protocol_version": PROTOCOL_VERSION,
            "families": list(supported_families()),
        }
        if self.runner is None:
            state = "missing" if self.missing_model is not None else "standby"
            return IdentityReply(
                **common, model_state=state, detail=(self.missing_model or "")[:600]
            )
        stage = self.runner.stage
        return IdentityReply(
            **common,
            family=wire_family(stage.config),
            model_state="loaded",
            identity=stage.identity,
        )

    async def _model_command(
        self, channel: SecureChannel, command: PrepareCommand, tensor: Any
    ) -> None:
        receiver = self.receiver
        if receiver is None:
            raise ProtocolViolation("this node takes no prepared copy (no model cache)")
        payload = bytes(tensor.data) if tensor is not None else b""
        if isinstance(command, PrepareData):
            try:
                await asyncio.to_thread(receiver.write, command.offset, payload)
            except (ValueError, OSError) as exc:
                raise ProtocolViolation(f"prepare data refused: {exc}") from None
        elif isinstance(command, PrepareCheck):
            try:
                manifest = parse_manifest(payload)
                state, names = await asyncio.to_thread(receiver.check, manifest)
            except (ValidationError, ValueError, OSError) as exc:
                detail = str(exc)[:600]
                await send_reply(channel, PrepareState(rid=command.rid, ok=False, error=detail))
                return
            log.info(
                "prepare: the cluster's copy of layers %d-%d: %s here (%d tensors, %.1f MB to "
                "receive, %.1f MB of it already here)",
                manifest.layers[0], manifest.layers[1] - 1, state.state, len(names),
                state.needed_bytes / 1e6, state.have_bytes / 1e6,
            )  # fmt: skip
            listing = np.frombuffer(json.dumps(names).encode(), dtype=np.uint8)
            await send_reply(channel, state.model_copy(update={"rid": command.rid}), listing)
        else:
            try:
                result = await asyncio.to_thread(receiver.commit)
            except (ValueError, OSError) as exc:
                result = PrepareResult(ok=False, error=str(exc)[:600])
            await send_reply(channel, result.model_copy(update={"rid": command.rid}))
