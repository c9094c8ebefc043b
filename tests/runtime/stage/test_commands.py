"""A stage's command table: every command the protocol can parse has exactly one handler, each
handler is a method of the part it is listed with and takes the command it is listed for, a
command without one is refused and counted as a malformed message, and the elastic state a
drain reports is the core enum, its value on the wire."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any, Literal, cast, get_args, get_type_hints

import pytest

from mlxppd.core.agent.elastic import ElasticState
from mlxppd.core.kv_admission import StageKvManager
from mlxppd.core.protocol.control import (
    Admission,
    Command,
    Configure,
    StageReport,
    Status,
    parse_control,
)
from mlxppd.core.stages import StageSpec
from mlxppd.core.strict import StrictModel
from mlxppd.runtime.stage import control
from mlxppd.runtime.stage.control import COMMANDS, StageCommands
from mlxppd.runtime.stage.reports import StageReports
from mlxppd.runtime.stage.state import ProtocolViolation
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import ChannelClosedError
from tests.support.wire import config, run

pytestmark = pytest.mark.timeout(60)

SERVED: tuple[type[Command], ...] = get_args(Command)


def test_every_command_the_protocol_parses_has_exactly_one_handler() -> None:
    assert len(SERVED) == len(set(SERVED)) == len(COMMANDS)
    assert set(COMMANDS) == set(SERVED)


def test_each_handler_takes_the_command_it_is_listed_for() -> None:
    for kind, (part, handler) in COMMANDS.items():
        assert getattr(part, handler.__name__) is handler, kind
        taken = get_type_hints(handler)["command"]
        assert kind in (get_args(taken) or (taken,)), (kind, handler.__name__)


def test_the_table_binds_to_the_parts_given_and_misses_none() -> None:
    """A part the table names and the worker did not build fails its construction."""
    with pytest.raises(KeyError):
        StageCommands([])


class Reboot(StrictModel):
    """A command no stage serves (one parse_control would refuse before it got here)."""

    op: Literal["reboot"] = "reboot"


def _worker() -> tuple[StageWorker, MlxThread]:
    spec = StageSpec(0, 1, 0, 4)
    runner = SimpleNamespace(
        stage=SimpleNamespace(parameter_bytes=1234, weights="native"),
        release=lambda seq: None,
        release_all=lambda: None,
    )
    kv = StageKvManager(stage_index=0, budget_bytes=1 << 20, bytes_per_token=16, max_sequences=4)
    mlx = MlxThread("test-mlx")
    transport = create_transport("tcp", config("stage-0"))
    return StageWorker(spec, cast(Any, runner), kv, transport, mlx), mlx


@asynccontextmanager
async def _coordinator_of(worker: StageWorker) -> AsyncIterator[SecureChannel]:
    host, port = await worker.start("127.0.0.1", 0)
    channel = await create_transport("tcp", config("coordinator")).connect(
        host, port, expected_peer="stage-0"
    )
    try:
        yield channel
    finally:
        await channel.close()


async def _ask(channel: SecureChannel, command: StrictModel) -> dict[str, Any]:
    await channel.send(MessageKind.CONTROL, command.model_dump(mode="json"))
    reply = await channel.recv()
    assert reply.kind is MessageKind.REPLY
    return dict(reply.meta)


def test_a_command_without_a_handler_is_refused() -> None:
    async def scenario() -> None:
        worker, mlx = _worker()
        try:
            with pytest.raises(ProtocolViolation, match="does not serve 'reboot'"):
                await worker.serve_command(cast(Any, None), cast(Any, Reboot()), None)
        finally:
            await worker.close()
            mlx.close()

    run(scenario)


def test_the_read_loop_refuses_and_counts_a_command_the_table_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without_status = {k: v for k, v in COMMANDS.items() if k is not Status}
    monkeypatch.setattr(control, "COMMANDS", without_status)

    async def scenario() -> None:
        worker, mlx = _worker()
        try:
            async with _coordinator_of(worker) as channel:
                assert (await _ask(channel, Configure(rid=1)))["ok"] is True
                await channel.send(MessageKind.CONTROL, Status(rid=2).model_dump())
                with pytest.raises(ChannelClosedError):
                    await channel.recv()  # closed, as for any malformed message
            assert worker.stats.protocol_errors == 1
        finally:
            await worker.close()
            mlx.close()

    run(scenario)


def test_the_elastic_state_is_the_core_enum_and_its_value_on_the_wire() -> None:
    async def scenario() -> None:
        worker, mlx = _worker()
        try:
            assert worker.elastic_state is ElasticState.IDLE
            async with _coordinator_of(worker) as channel:
                assert (await _ask(channel, Configure(rid=1)))["ok"] is True
                closing = Admission(rid=2, open=False, state=str(ElasticState.DRAINING))
                assert (await _ask(channel, closing))["ok"] is True
                assert worker.elastic_state is ElasticState.DRAINING and not worker.admitting
                report = StageReport.model_validate(await _ask(channel, Status(rid=3)))
                assert (report.admission, report.elastic_state) == ("draining", "draining")
                # A state no elastic machine has is malformed: refused, counted, unchanged.
                bogus = Admission(rid=4, open=True, state="loading")
                await channel.send(MessageKind.CONTROL, bogus.model_dump())
                with pytest.raises(ChannelClosedError):
                    await channel.recv()
            assert worker.stats.protocol_errors == 1
            assert worker.elastic_state is ElasticState.DRAINING and not worker.admitting
        finally:
            await worker.close()
            mlx.close()

    run(scenario)


def test_parse_control_yields_only_types_the_table_holds() -> None:
    status = parse_control({"op": "status", "rid": 7})
    assert type(status) in COMMANDS
    assert COMMANDS[type(status)] == (StageReports, StageReports.on_status)
