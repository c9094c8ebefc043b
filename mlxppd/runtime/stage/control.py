"""A stage worker's control plane: one table from each command to the part and method that
handle it.

The read loop (``worker.py``) parses a CONTROL message into its command and hands it to
``StageCommands``, which looks its type up among the handlers it bound from :data:`COMMANDS`
when the worker was built; a command without a handler is refused like a malformed message.
The handlers live by concern, each a part of its own over the shared ``StageState``: the
coordinator's link (Configure, Heartbeat) in ``link.py``, a sequence's KV in ``admission.py``,
the elastic drain and layer moves in ``layer_moves.py``, status and traces in ``reports.py``,
adapters in ``adapter_commands.py``, identity and a prepared copy in ``model_commands.py``.
Each answers on the channel itself, or not at all (Release, Forget, Heartbeat).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import MappingProxyType, MethodType
from typing import Any

from mlxppd.core.protocol.adapters import AdapterLoad, AdapterUnload
from mlxppd.core.protocol.control import (
    Admission,
    Admit,
    Command,
    Configure,
    Forget,
    Heartbeat,
    Reassign,
    Release,
    Status,
    TraceDump,
)
from mlxppd.core.protocol.model_transfer import (
    Identify,
    PrepareCheck,
    PrepareCommit,
    PrepareData,
)
from mlxppd.runtime.stage.adapter_commands import StageAdapters
from mlxppd.runtime.stage.admission import StageAdmission
from mlxppd.runtime.stage.layer_moves import LayerMoves
from mlxppd.runtime.stage.link import CoordinatorLink
from mlxppd.runtime.stage.model_commands import ModelCommands
from mlxppd.runtime.stage.reports import StageReports
from mlxppd.runtime.stage.state import ProtocolViolation
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Tensor

#: a handler as declared on its part: called with the part, the channel the command came on,
#: the command and its tensor
Handler = Callable[[Any, SecureChannel, Any, Tensor | None], Awaitable[None]]
#: which part serves a command, and which of its methods
Route = tuple[type[Any], Handler]

#: every command a stage serves, and the one handler that serves it
COMMANDS: Mapping[type[Command], Route] = MappingProxyType(
    {
        Configure: (CoordinatorLink, CoordinatorLink.on_configure),
        Heartbeat: (CoordinatorLink, CoordinatorLink.on_heartbeat),
        Admit: (StageAdmission, StageAdmission.on_admit),
        Release: (StageAdmission, StageAdmission.on_release),
        Forget: (StageAdmission, StageAdmission.on_forget),
        Admission: (LayerMoves, LayerMoves.on_admission),
        Reassign: (LayerMoves, LayerMoves.on_reassign),
        Status: (StageReports, StageReports.on_status),
        TraceDump: (StageReports, StageReports.on_trace),
        AdapterLoad: (StageAdapters, StageAdapters.on_adapter),
        AdapterUnload: (StageAdapters, StageAdapters.on_adapter),
        Identify: (ModelCommands, ModelCommands.on_identify),
        PrepareCheck: (ModelCommands, ModelCommands.on_prepare),
        PrepareData: (ModelCommands, ModelCommands.on_prepare),
        PrepareCommit: (ModelCommands, ModelCommands.on_prepare),
    }
)


class StageCommands:
    """Every command of the coordinator on a stage, each bound to the part that serves it."""

    def __init__(self, parts: Iterable[object]) -> None:
        # Bound once, from the table as it is now; a part the table names and the worker
        # did not build is a KeyError here, at construction, not on the first command.
        by_class = {type(part): part for part in parts}
        self._handlers = {
            kind: MethodType(handler, by_class[part]) for kind, (part, handler) in COMMANDS.items()
        }

    async def serve(self, channel: SecureChannel, command: Command, tensor: Tensor | None) -> None:
        """Run ``command``'s handler; a command no stage serves is a ProtocolViolation."""
        handler = self._handlers.get(type(command))
        if handler is None:
            raise ProtocolViolation(f"a stage does not serve {command.op!r} commands")
        await handler(channel, command, tensor)
