"""The last stage's admission of constrained sequences, on a real stage worker over loopback:
loading the tokenizer and compiling a grammar never stop it answering (heartbeats go on, a
Status is answered, the admit's reply comes when the grammar is ready); the ``n`` choices of
one schema compile it once; a compile past the limit is refused, naming it, with its KV given
back; and a replayed sequence's grammar starts from the tokens it sent before the failover."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxppd.core.profile.model import read_model_config
from mlxppd.core.protocol.control import Admit, AdmitReply, Configure, Status
from mlxppd.core.protocol.sampling import GrammarSpec, SamplerSpec
from mlxppd.core.stages import StageSpec
from mlxppd.core.strict import StrictModel
from mlxppd.engine.grammar import Constraint
from mlxppd.engine.grammar_compiles import GrammarCompiles
from mlxppd.engine.sampling import constraint_for
from mlxppd.engine.tokenizer import load_tokenizer
from mlxppd.runtime.stage.loader import load_stage_runner, stage_kv_manager
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from tests.support.wire import config, run

pytestmark = pytest.mark.timeout(180)

LAST = StageSpec(1, 2, 2, 4)  # the chat llama's last two layers, with the output head
PERSON = GrammarSpec(
    kind="json_schema",
    schema_text=json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        }
    ),
)
#: how long an injected slow step waits for the test to let it go (a safety net: the tests
#: let it go themselves)
HELD_S = 20.0


class Gate:
    """A slow step on the grammar pool's thread: it says it started, then waits to be let go."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.calls = 0

    def hold(self) -> None:
        self.calls += 1
        self.entered.set()
        self.opened.wait(HELD_S)


class Peer:
    """The coordinator's end of the link: commands out, replies in by rid, heartbeats counted."""

    def __init__(self, channel: SecureChannel) -> None:
        self.channel = channel
        self.beats = 0
        self.arrived: list[int] = []  # reply rids in the order they came
        self._replies: dict[int, dict[str, Any]] = {}

    async def send(self, command: StrictModel, spec: SamplerSpec | None = None) -> None:
        payload = np.frombuffer(spec.model_dump_json().encode(), np.uint8) if spec else None
        await self.channel.send(MessageKind.CONTROL, command.model_dump(mode="json"), payload)

    async def reply(self, rid: int) -> dict[str, Any]:
        while rid not in self._replies:
            message = await self.channel.recv()
            if message.kind is MessageKind.CONTROL:
                self.beats += 1  # the stage's heartbeat
            elif message.kind is MessageKind.REPLY:
                self.arrived.append(message.meta["rid"])
                self._replies[message.meta["rid"]] = dict(message.meta)
        return self._replies[rid]

    async def beats_past(self, count: int) -> None:
        """Read until ``count`` more heartbeats came (replies are kept for ``reply``)."""
        target = self.beats + count
        while self.beats < target:
            message = await self.channel.recv()
            if message.kind is MessageKind.CONTROL:
                self.beats += 1
            elif message.kind is MessageKind.REPLY:
                self.arrived.append(message.meta["rid"])
                self._replies[message.meta["rid"]] = dict(message.meta)


def admit(rid: int, seq: str, first_draw: int = 0) -> Admit:
    return Admit(rid=rid, seq=seq, prompt_tokens=8, max_tokens=16, commit=True,
                 first_draw=first_draw)  # fmt: skip


@asynccontextmanager
async def last_stage(
    model: Path, grammars: GrammarCompiles
) -> AsyncIterator[tuple[StageWorker, Peer, MlxThread]]:
    """The real last stage of ``model`` listening on loopback, configured by a coordinator
    that asks for a heartbeat every 50 ms."""
    mlx = MlxThread("grammar-admission-mlx")
    worker = None
    channel = None
    try:
        runner, per_token = await load_stage_runner(mlx, model, LAST, read_model_config(model))
        kv = stage_kv_manager(LAST, per_token, None, 32)
        transport = create_transport("tcp", config("stage-1"))
        worker = StageWorker(LAST, runner, kv, transport, mlx, grammars=grammars)
        host, port = await worker.start("127.0.0.1", 0)
        channel = await create_transport("tcp", config("coordinator")).connect(
            host, port, expected_peer="stage-1"
        )
        peer = Peer(channel)
        await peer.send(Configure(rid=1, heartbeat_interval_s=0.05, heartbeat_timeout_s=60))
        assert (await peer.reply(1))["ok"] is True
        yield worker, peer, mlx
    finally:
        if channel is not None:
            await channel.close()
        if worker is not None:
            await worker.close()
        mlx.close()


def slow_tokenizer(model: Path, gate: Gate) -> Callable[[], Any]:
    def load() -> Any:
        gate.hold()
        return load_tokenizer(model)

    return load


def slow_compile(gate: Gate) -> Callable[[GrammarSpec, Any, int], Constraint | None]:
    def compile(grammar: GrammarSpec, tokenizer: Any, vocab: int) -> Constraint | None:
        gate.hold()
        return constraint_for(grammar, tokenizer, vocab)

    return compile


def test_heartbeats_and_a_status_are_answered_while_the_tokenizer_loads(chat_llama: Path) -> None:
    """The first constrained request after a start loads the tokenizer (seconds on a real
    model): the stage keeps beating and answering, and the admit's reply comes after."""
    gate = Gate()

    async def scenario() -> tuple[list[int], int, dict[str, Any]]:
        grammars = GrammarCompiles(slow_tokenizer(chat_llama, gate))
        async with last_stage(chat_llama, grammars) as (_, peer, _mlx):
            try:
                await peer.send(admit(2, "a"), SamplerSpec(grammar=GrammarSpec(kind="json_object")))
                await asyncio.to_thread(gate.entered.wait, HELD_S)
                await peer.send(Status(rid=3))
                await peer.reply(3)
                await peer.beats_past(3)  # still loading: the stage says it is alive
                beats_while_loading = peer.beats
            finally:
                gate.opened.set()
            admitted = await peer.reply(2)
            return peer.arrived, beats_while_loading, admitted

    arrived, beats, admitted = run(scenario)
    assert arrived[1:] == [3, 2]  # after the configure: the status first, the admit when ready
    assert beats >= 3
    assert AdmitReply.model_validate(admitted).ok


def test_sixteen_choices_of_one_schema_compile_it_once_while_the_stage_goes_on_answering(
    chat_llama: Path,
) -> None:
    gate = Gate()

    async def scenario() -> tuple[list[bool], bool, list[int]]:
        tokenizer = load_tokenizer(chat_llama)
        grammars = GrammarCompiles(lambda: tokenizer, compile=slow_compile(gate))
        async with last_stage(chat_llama, grammars) as (worker, peer, _mlx):
            spec = SamplerSpec(grammar=PERSON)
            try:
                for i in range(16):
                    await peer.send(admit(10 + i, f"choice-{i}"), spec)
                await asyncio.to_thread(gate.entered.wait, HELD_S)
                await peer.send(Status(rid=3))
                await peer.reply(3)  # answered while the schema compiles
            finally:
                gate.opened.set()
            oks = [AdmitReply.model_validate(await peer.reply(10 + i)).ok for i in range(16)]
            await peer.send(admit(40, "later"), spec)  # a later request, the same schema
            later = AdmitReply.model_validate(await peer.reply(40)).ok
            assert len(worker.kv.reserved) == 17
            return oks, later, peer.arrived

    oks, later, arrived = run(scenario)
    assert all(oks) and later
    assert gate.calls == 1  # one compile for all seventeen
    assert arrived.index(3) < arrived.index(10)


def test_a_compile_past_the_limit_is_refused_naming_it_and_its_kv_is_given_back(
    chat_llama: Path,
) -> None:
    gate = Gate()

    async def scenario() -> tuple[AdmitReply, int]:
        tokenizer = load_tokenizer(chat_llama)
        grammars = GrammarCompiles(lambda: tokenizer, 0.2, compile=slow_compile(gate))
        async with last_stage(chat_llama, grammars) as (worker, peer, _mlx):
            try:
                await peer.send(admit(2, "slow"), SamplerSpec(grammar=PERSON))
                refused = AdmitReply.model_validate(await peer.reply(2))
            finally:
                gate.opened.set()
            return refused, len(worker.kv.reserved)

    refused, held = run(scenario)
    assert not refused.ok and refused.diagnostic is not None
    assert refused.diagnostic.reason == "invalid_request"
    assert refused.diagnostic.detail is not None
    assert "grammar compile limit of 0.2 s ([cluster] grammar_compile_limit_s)" in (
        refused.diagnostic.detail
    )
    assert held == 0


def test_a_replayed_sequence_samples_from_where_its_grammar_was_when_the_stage_was_lost(
    chat_llama: Path,
) -> None:
    """Its tokens so far reach the last stage only as stage 0's prefill: the admission carries
    them, and the grammar follows them before the first draw of the replay."""

    async def scenario() -> tuple[str, str, list[AdmitReply]]:
        tokenizer = load_tokenizer(chat_llama)
        sent = [int(t) for t in tokenizer.encode('{"name": "Ada", "age', add_special_tokens=False)]
        wrong = [int(t) for t in tokenizer.encode('{"colour', add_special_tokens=False)]
        async with last_stage(chat_llama, GrammarCompiles(lambda: tokenizer)) as (
            worker, peer, mlx,
        ):  # fmt: skip
            await peer.send(admit(2, "fresh"), SamplerSpec(grammar=PERSON))
            await peer.send(
                admit(3, "replayed", len(sent)), SamplerSpec(grammar=PERSON, replay=sent)
            )
            for rid in (2, 3):
                assert AdmitReply.model_validate(await peer.reply(rid)).ok
            refusals = []
            await peer.send(admit(4, "bad", len(wrong)), SamplerSpec(grammar=PERSON, replay=wrong))
            await peer.send(
                admit(5, "short", len(sent) + 1), SamplerSpec(grammar=PERSON, replay=sent)
            )
            for rid in (4, 5):
                refusals.append(AdmitReply.model_validate(await peer.reply(rid)))

            def first_tokens() -> tuple[int, int]:  # on the mlx thread, as compute runs it
                hidden = mx.random.normal((1, 1, 64), key=mx.random.key(0))
                runner = worker.runner
                assert runner is not None
                fresh = runner.forward_and_sample("fresh", hidden, False).token
                return fresh, runner.forward_and_sample("replayed", hidden, False).token

            fresh, replayed = await mlx.run(first_tokens)
            return tokenizer.decode([fresh]), tokenizer.decode([replayed]), refusals

    fresh, replayed, (bad, short) = run(scenario)
    assert fresh.startswith("{")  # a fresh grammar opens the object
    assert replayed.startswith('"')  # the replayed one closes the key "age"
    for refusal in (bad, short):
        assert not refusal.ok and refusal.diagnostic is not None
    assert "is not allowed by the grammar" in (bad.diagnostic.detail or "")
    assert "a replay carries every token sent before it" in (short.diagnostic.detail or "")
