"""The typed control plane: commands and replies as models, one request/reply helper, and a
stage worker that answers in models and counts a bad control frame."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pydantic import ValidationError

from mlxppd.core.kv_admission import AdmissionDiagnostic, RejectReason, StageKvManager
from mlxppd.core.protocol.control import (
    Ack,
    Admission,
    Admit,
    AdmitRefusal,
    AdmitReply,
    Command,
    Configure,
    LatencyReport,
    Reassign,
    ReassignReply,
    Release,
    ReloadReport,
    StageReport,
    Status,
    TraceDump,
    WireCounters,
    clip,
    parse_control,
    parse_trace_events,
    text_bytes,
)
from mlxppd.core.stages import StageSpec
from mlxppd.runtime.coordinator.control_client import BadReplyError, ControlClient
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind, encode_parts
from mlxppd.wire.errors import FrameRejectReason, HandshakeFailure
from mlxppd.wire.handshake import Verdict
from mlxppd.wire.limits import FrameLimits
from tests.support.wire import config, run, serve

pytestmark = pytest.mark.timeout(60)

BIG = 1 << 62

COMMANDS: list[Command] = [
    Admit(rid=3, seq="r.1", prompt_tokens=5, max_tokens=7, commit=True, plan=[(0, 4), (4, 8)]),
    Release(seq="r.1"),
    Configure(rid=1, next_host="10.0.0.2", next_port=19001, next_node="stage-1", trace=True),
    Status(rid=2),
    TraceDump(rid=4),
    Admission(rid=5, open=False, state="draining"),
    Reassign(rid=6, phase="prepare", plan=[(0, 10), (10, 30)]),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.op)
def test_every_command_is_parsed_back_into_itself(command: Command) -> None:
    meta = command.model_dump(mode="json")
    assert meta["op"] == command.op
    assert parse_control(meta) == command


@pytest.mark.parametrize(
    "meta",
    [
        {"op": "reboot", "rid": 1},
        {"rid": 1},
        {"op": "status", "rid": 1, "extra": True},
        {"op": "status", "rid": -1},
        {"op": "admit", "rid": 1, "seq": "", "prompt_tokens": 1, "max_tokens": 1, "commit": 1},
        {"op": "reassign", "rid": 1, "phase": "maybe", "plan": [[0, 1]]},
        {"op": "configure", "rid": 1, "next_port": 70000},
    ],
    ids=["unknown op", "no op", "unknown field", "negative rid", "bad admit", "bad phase", "port"],
)
def test_a_bad_command_is_refused(meta: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        parse_control(meta)


def test_replies_are_read_as_models() -> None:
    diagnostic = AdmissionDiagnostic(1, RejectReason.MEMORY, 100, 50, 120, 2)
    refused = AdmitReply(rid=1, ok=False, diagnostic=AdmitRefusal.of(diagnostic))
    parsed = AdmitReply.model_validate(refused.model_dump(mode="json"))
    assert parsed.refusal(0) == diagnostic
    assert AdmitReply(ok=True).refusal(0) is None
    bare = AdmitReply(ok=False).refusal(3)
    assert bare is not None and (bare.stage_index, bare.reason) == (3, "rejected_by_stage")

    prepared = ReassignReply.model_validate(
        {"rid": 2, "ok": True, "layers": [0, 10], "loaded_tensors": 0, "reused_tensors": 9,
         "load_s": 0.5}
    )  # fmt: skip
    load = prepared.load()
    assert load is not None and load.layers == (0, 10) and load.reused_tensors == 9
    assert ReassignReply(ok=False, error="no room").load() is None
    with pytest.raises(ValidationError):
        Ack.model_validate({"rid": 1, "ok": True, "surprise": 1})


def test_free_text_is_clipped_to_json_bytes() -> None:
    for text in ["€" * 5000, "\x01" * 5000, "a" * 5000, "😀" * 5000]:
        clipped = clip(text)
        assert clipped is not None and clipped.endswith("…")
        assert text_bytes(clipped) <= 600
    assert clip("short") == "short" and clip(None) is None
    with pytest.raises(ValidationError):
        Ack(ok=False, error="\x01" * 200)  # 1200 bytes of JSON escapes


def largest_report() -> StageReport:
    return StageReport(
        node_id="n" * 128, config_generation="g" * 64, last_reload_error=clip("€\x01" * 500),
        reload_failures=BIG, memory_budget_bytes=BIG,
        last_reload=ReloadReport(
            layers="1048576-1048576", drain_s=1e9, load_s=1e9, total_s=1e9, loaded_tensors=BIG,
            reused_tensors=BIG,
        ),
        rid=BIG, stage=4096, layers=(1 << 20, 1 << 20), parameter_bytes=BIG, weights="w" * 32,
        blas=clip("\x01" * 900), kv_used_bytes=BIG, kv_budget_bytes=BIG, active_sequences=BIG,
        forwards=BIG, busy_fraction=0.123456789, protocol_errors=BIG, batched_passes=BIG,
        batched_rows=BIG, busy_s=1.2345678e9, active_s=1.2345678e9, wall_s=1.2345678e9,
        activation_latency=LatencyReport(counts=[BIG] * 14, sum=1.2e9, count=BIG, max=1.2e9),
        wire=WireCounters(
            handshake_failures={str(h): BIG for h in HandshakeFailure},
            rejected_frames={str(f): BIG for f in FrameRejectReason},
            verdicts_sent={v.name.lower(): BIG for v in Verdict},
            channels_established=BIG,
        ),
        trace_dropped=BIG, admission="draining", elastic_state="😀" * 32, now=1.7e9,
    )  # fmt: skip


def test_a_stage_report_at_its_largest_fits_the_default_metadata_limit() -> None:
    report = largest_report()
    head, _ = encode_parts(MessageKind.REPLY, report.model_dump(mode="json"), None, FrameLimits())
    assert len(head) <= FrameLimits().max_metadata_bytes
    assert StageReport.model_validate(report.model_dump(mode="json")) == report


def test_trace_events_are_validated() -> None:
    good = (
        b'[{"name":"stage","ph":"X","ts":1.0,"dur":2.0,"pid":"stage-1","tid":1,"args":{"rows":1}}]'
    )
    (event,) = parse_trace_events(good)
    assert (event.name, event.dur, event.args) == ("stage", 2.0, {"rows": 1})
    assert parse_trace_events(b"") == []
    with pytest.raises(ValidationError):
        parse_trace_events(b'[{"name":"x","ph":"X","ts":1,"pid":"p","tid":0,"args":{"a":[1]}}]')


# -- the request/reply helper over a real loopback channel -------------------------------------


async def _pair(handler: Any) -> tuple[Any, SecureChannel]:
    server = create_transport("tcp", config("server"))
    client = create_transport("tcp", config("client"))
    listener = await serve(server, handler)
    channel = await client.connect(*listener.address, expected_peer="server")
    return listener, channel


def test_the_helper_parses_the_reply_and_refuses_a_malformed_one() -> None:
    async def answer(channel: SecureChannel) -> None:
        async for message in channel:
            command = parse_control(message.meta)
            assert isinstance(command, Status | Admission)
            if isinstance(command, Admission):  # a reply of the wrong shape
                await channel.send(MessageKind.REPLY, {"rid": command.rid, "okay": True})
            # Status: never answered

    async def scenario() -> None:
        listener, channel = await _pair(answer)
        control = ControlClient(channel, timeout_s=0.2)
        reader = asyncio.create_task(control.read_replies())
        try:
            with pytest.raises(BadReplyError, match="malformed Ack"):
                await control.ask(Admission(open=True), Ack)
            with pytest.raises(TimeoutError):
                await control.ask(Status(), StageReport)
        finally:
            await channel.close()
            await reader
            await listener.close()

    run(scenario)


# -- a stage worker answers in models and counts a bad control frame ---------------------------


def _worker() -> tuple[StageWorker, MlxThread]:
    spec = StageSpec(0, 1, 0, 4)
    runner = SimpleNamespace(
        stage=SimpleNamespace(parameter_bytes=1234, weights="native"),
        release=lambda seq: None,
        release_all=lambda: None,
        set_sampler=lambda *args: None,
    )
    kv = StageKvManager(stage_index=0, budget_bytes=1 << 20, bytes_per_token=16, max_sequences=4)
    mlx = MlxThread("test-mlx")
    transport = create_transport("tcp", config("stage-0"))
    return StageWorker(spec, cast(Any, runner), kv, transport, mlx), mlx


def test_a_stage_answers_typed_replies_and_counts_a_bad_control_frame() -> None:
    async def scenario() -> None:
        worker, mlx = _worker()
        host, port = await worker.start("127.0.0.1", 0)
        client = create_transport("tcp", config("coordinator"))
        try:
            channel = await client.connect(host, port, expected_peer="stage-0")
            control = ControlClient(channel, timeout_s=10)
            reader = asyncio.create_task(control.read_replies())
            assert (await control.ask(Configure(), Ack)).ok
            admit = Admit(seq="a.0", prompt_tokens=4, max_tokens=4, commit=True, plan=[(0, 4)])
            assert (await control.ask(admit, AdmitReply)).ok
            elsewhere = Admit(**{**admit.model_dump(), "plan": [(0, 3)]})
            refused = await control.ask(elsewhere, AdmitReply)
            assert refused.refusal(0) is not None
            assert refused.refusal(0).reason is RejectReason.PLAN_MISMATCH  # type: ignore[union-attr]
            assert (await control.ask(Admission(open=False, state="draining"), Ack)).ok
            report = await control.ask(Status(), StageReport)
            assert (report.stage, report.layers, report.kv_used_bytes) == (0, (0, 4), 8 * 16)
            assert (report.admission, report.elastic_state) == ("draining", "draining")
            assert report.parameter_bytes == 1234 and report.protocol_errors == 0
            await channel.send(MessageKind.CONTROL, {"op": "reboot", "rid": 99})
            await reader  # the stage closed the channel: refused, as any malformed message
            assert worker.stats.protocol_errors == 1
        finally:
            await worker.close()
            mlx.close()

    run(scenario)
