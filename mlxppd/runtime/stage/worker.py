"""A stage worker: serves one layer range on its transport address.

Input (token ids on stage 0, activations elsewhere) arrives on any accepted channel and is run
in arrival order on the mlx thread; each result is queued for a sender task, so the next
forward computes while the previous activation is on the wire (``compute.py``). The
coordinator's channel carries control commands, each served by its handler in ``control.py``'s
table; on the last stage it also carries the sampled tokens back. The worker is a composition:
one shared ``StageState`` (``state.py``) and parts built over it, each with one concern; this
module builds them and is the worker's life (listen, drain, rebind, close) and its read loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import ValidationError

from mlxppd.core.agent.elastic import ElasticState
from mlxppd.core.kv_admission import StageKvManager
from mlxppd.core.protocol.control import Command, parse_control
from mlxppd.core.stages import StageSpec
from mlxppd.engine.grammar_compiles import GrammarCompiles
from mlxppd.engine.mlx_memory import CacheKeeper
from mlxppd.engine.prepared_copy import ModelReceiver
from mlxppd.engine.stage_runner import StageRunner
from mlxppd.runtime.stage.adapter_commands import StageAdapters
from mlxppd.runtime.stage.admission import StageAdmission
from mlxppd.runtime.stage.compute import StageCompute
from mlxppd.runtime.stage.control import StageCommands
from mlxppd.runtime.stage.layer_moves import LayerMoves
from mlxppd.runtime.stage.link import CoordinatorLink
from mlxppd.runtime.stage.model_commands import ModelCommands
from mlxppd.runtime.stage.reports import StageReports
from mlxppd.runtime.stage.state import ProtocolViolation, StageState
from mlxppd.runtime.stage.tp_links import FollowerLinks
from mlxppd.runtime.stage.work import ExtrasSource, PrepareLayers, StageStats
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Message, MessageKind, Tensor
from mlxppd.wire.errors import ChannelClosedError, FrameError
from mlxppd.wire.tasks import spawn, stop_tasks
from mlxppd.wire.transport import Listener, Transport

log = logging.getLogger("mlxppd.stage")


class StageWorker:
    """One stage: the data plane and the command handlers, each a part over one state."""

    def __init__(
        self,
        spec: StageSpec,
        runner: StageRunner | None,
        kv: StageKvManager,
        transport: Transport,
        mlx: MlxThread,
        *,
        extras: ExtrasSource | None = None,
        prepare_layers: PrepareLayers | None = None,
        receiver: ModelReceiver | None = None,
        missing_model: str | None = None,
        grammars: GrammarCompiles | None = None,
    ) -> None:
        """``grammars``: the last stage's output grammars (its tokenizer, compile limit)."""
        self._state = state = StageState(spec, runner, kv, transport, mlx)
        self.compute = StageCompute(state)
        self.moves = LayerMoves(state, prepare_layers)
        self.admission = StageAdmission(state, grammars)
        self.commands = StageCommands(
            [
                CoordinatorLink(state),
                self.admission,
                self.moves,
                StageReports(state, extras),
                StageAdapters(state, self.moves),
                ModelCommands(state, receiver, missing_model),
            ]
        )
        #: rank 0 of a tensor-parallel stage: its links to the other ranks
        self.followers: FollowerLinks | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._listener: Listener | None = None

    # -- what the node and its agent read (the shared state's) ---------------------------------

    @property
    def spec(self) -> StageSpec:
        return self._state.spec

    @property
    def runner(self) -> StageRunner | None:
        return self._state.runner

    @property
    def kv(self) -> StageKvManager:
        return self._state.kv

    @property
    def stats(self) -> StageStats:
        return self._state.stats

    @property
    def cache(self) -> CacheKeeper:
        """mlx's buffer cache on this process: its cap, and when it goes back."""
        return self._state.cache

    @property
    def admitting(self) -> bool:
        return self._state.admitting

    @property
    def elastic_state(self) -> ElasticState:
        return self._state.elastic_state

    @property
    def ring_lost(self) -> asyncio.Event:
        """Set when a tensor-parallel rank of this stage is gone (``StageCompute.rank_lost``)."""
        return self._state.ring_lost

    @property
    def slot_nodes(self) -> tuple[tuple[str, int], ...]:
        """A tensor-parallel stage's slots: every rank's node id and shard bytes, rank order."""
        return self._state.slot_nodes

    @slot_nodes.setter
    def slot_nodes(self, nodes: tuple[tuple[str, int], ...]) -> None:
        self._state.slot_nodes = nodes

    def rank_lost(self, why: str) -> None:
        self.compute.rank_lost(why)

    async def swap(self, spec: StageSpec, runner: StageRunner, kv: StageKvManager) -> None:
        await self.moves.swap(spec, runner, kv)

    async def serve_command(
        self, channel: SecureChannel, command: Command, tensor: Tensor | None
    ) -> None:
        await self.commands.serve(channel, command, tensor)

    # -- life ----------------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> tuple[str, int]:
        await self._state.mlx.run(self._state.cache.start)
        self._loops = [
            spawn(
                self.compute.compute_loop(), name=f"stage{self.spec.index}-compute", forever=True
            ),
            spawn(self.compute.send_loop(), name=f"stage{self.spec.index}-send", forever=True),
        ]
        self._listener = await self._state.transport.listen(host, port, self._serve)
        return self._listener.address

    @property
    def address(self) -> tuple[str, int] | None:
        return self._listener.address if self._listener is not None else None

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Stop admitting; True once no sequence holds KV here, False at the timeout."""
        self._state.admitting = False
        deadline = time.monotonic() + timeout_s
        while self._state.kv.reserved:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def resume(self) -> None:
        self._state.admitting = True

    async def rebind(self, transport: Transport, host: str, port: int) -> tuple[str, int]:
        """Listen again (another address or transport); peers reconnect to the new one."""
        if self._listener is not None:
            await self._listener.close()
        s = self._state
        if s.downstream is not None and s.downstream is not s.coordinator:
            await s.downstream.close()
        s.downstream = None
        s.transport = transport
        self._listener = await transport.listen(host, port, self._serve)
        return self._listener.address

    async def close(self) -> None:
        s = self.stats
        mean_rows = s.batched_rows / s.batched_passes if s.batched_passes else 0.0
        log.info(
            "stage %d: %d forward passes, %d of them micro-batches of %.2f sequences on average",
            self.spec.index, s.forwards, s.batched_passes, mean_rows,
        )  # fmt: skip
        if self._listener is not None:
            await self._listener.close()
        await stop_tasks(*self._loops, *self._state.side_tasks)
        self.admission.close()
        if self._state.downstream is not None:
            await self._state.downstream.close()
        if self.followers is not None:
            await self.followers.close()  # each other rank sees its link close and stops

    # -- connections ---------------------------------------------------------------------------

    async def _serve(self, channel: SecureChannel) -> None:
        try:
            while (message := await self._receive(channel)) is not None:
                await self._route(channel, message)
        except (ChannelClosedError, FrameError) as exc:
            log.info("stage %d: channel %s closed: %s", self.spec.index, channel.peer_address, exc)
        except (ValidationError, ProtocolViolation) as exc:
            self.stats.protocol_errors += 1
            detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            log.warning(
                "stage %d: malformed message from %s, closing: %s",
                self.spec.index,
                channel.peer_address,
                detail,
            )
        finally:
            await channel.close()
            if channel is self._state.coordinator:
                # The coordinator is gone: nobody will release its sequences. The accounting
                # frees at once (a new coordinator's admissions and layer moves see it empty);
                # the caches go in order on the compute loop.
                self._state.coordinator = None
                await self._state.work.put(self._state.release_accounting())

    async def _receive(self, channel: SecureChannel) -> Message | None:
        """The next message; None when the peer said goodbye, or when it is the coordinator
        and it stayed silent past its heartbeat timeout (a hung or cut-off coordinator is a
        lost one: the caller frees its sequences)."""
        timeout = self._state.heartbeat_timeout_s if channel is self._state.coordinator else None
        try:
            async with asyncio.timeout(timeout):
                return await channel.recv()
        except TimeoutError:
            log.warning(
                "stage %d: no word from the coordinator at %s for %.1f s; dropping it and its "
                "sequences", self.spec.index, channel.peer_address, timeout,
            )  # fmt: skip
            return None
        except ChannelClosedError as exc:
            if exc.clean:
                return None
            raise

    async def _route(self, channel: SecureChannel, message: Message) -> None:
        if message.kind is MessageKind.ACTIVATION:
            await self.compute.accept_activation(message)
            return
        if message.kind is not MessageKind.CONTROL:
            raise ProtocolViolation(f"a stage does not accept {message.kind.name} messages")
        # One parse: an unknown op or field is a ValidationError, counted by ``_serve``.
        await self.commands.serve(channel, parse_control(message.meta), message.tensor)
