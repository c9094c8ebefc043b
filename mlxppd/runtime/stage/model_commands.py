"""A stage worker's model commands: what it serves (``Identify``) and receiving a prepared copy
(``PrepareCheck`` / ``PrepareData`` / ``PrepareCommit``, ``engine/prepared_copy.py``).

A part of ``StageWorker`` over the shared ``StageState``. Hashing and file writes run in a
thread so the channel's event loop keeps answering; a prepare's data arrives in order on its own
channel, so appends stay ordered.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import numpy as np
from pydantic import ValidationError

import mlxppd
from mlxppd.core.errors import MlxppError
from mlxppd.core.log_text import escape
from mlxppd.core.protocol.model_transfer import (
    Identify,
    IdentityReply,
    PrepareCheck,
    PrepareCommit,
    PrepareData,
    PrepareResult,
    PrepareState,
    parse_manifest,
)
from mlxppd.engine.families import supported_families, wire_family
from mlxppd.engine.prepared_copy import ModelReceiver
from mlxppd.runtime.stage.state import ProtocolViolation, StageState, send_reply
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Tensor
from mlxppd.wire.version import PROTOCOL_VERSION

log = logging.getLogger("mlxppd.stage")

PrepareCommand = PrepareCheck | PrepareData | PrepareCommit


class ModelCommands:
    """Identity and prepare commands on a stage."""

    def __init__(
        self,
        state: StageState,
        receiver: ModelReceiver | None = None,
        missing_model: str | None = None,
    ) -> None:
        self._state = state
        # Where mlxppctl prepare's tensors go (None: this node takes none), and why this node
        # serves nothing yet when its model files are missing.
        self._receiver = receiver
        self._missing_model = missing_model

    async def on_identify(
        self, channel: SecureChannel, command: Identify, tensor: Tensor | None
    ) -> None:
        await send_reply(channel, self.identify(command.rid))

    def identify(self, rid: int = 0) -> IdentityReply:
        common: dict[str, Any] = {
            "rid": rid,
            "package_version": mlxppd.__version__,
            "protocol_version": PROTOCOL_VERSION,
            "families": list(supported_families()),
        }
        if self._state.runner is None:
            state = "missing" if self._missing_model is not None else "standby"
            return IdentityReply(
                **common, model_state=state, detail=(self._missing_model or "")[:600]
            )
        stage = self._state.runner.stage
        return IdentityReply(
            **common,
            family=wire_family(stage.config),
            model_state="loaded",
            identity=stage.identity,
        )

    async def on_prepare(
        self, channel: SecureChannel, command: PrepareCommand, tensor: Tensor | None
    ) -> None:
        receiver = self._receiver
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
            except (ValidationError, ValueError, OSError, MlxppError) as exc:
                # This prepare fails alone: the copy installed here, the channel and any other
                # prepare's plan stay as they were.
                detail = str(exc)[:600]
                log.warning(
                    "prepare: refused the manifest from %s: %s",
                    channel.peer_address, escape(detail, 600),
                )  # fmt: skip
                await send_reply(channel, PrepareState(rid=command.rid, ok=False, error=detail))
                return
            log.info(
                "prepare: the cluster's copy of layers %d-%d: %s here (%d tensors and %d files,"
                " %.1f MB to receive, %.1f MB of it already here)",
                manifest.layers[0], manifest.layers[1] - 1, state.state, len(names),
                len(state.files), state.needed_bytes / 1e6, state.have_bytes / 1e6,
            )  # fmt: skip
            listing = np.frombuffer(json.dumps(names).encode(), dtype=np.uint8)
            await send_reply(channel, state.model_copy(update={"rid": command.rid}), listing)
        else:
            try:
                result = await asyncio.to_thread(receiver.commit)
            except (ValueError, OSError, MlxppError) as exc:
                result = PrepareResult(ok=False, error=str(exc)[:600])
            await send_reply(channel, result.model_copy(update={"rid": command.rid}))
