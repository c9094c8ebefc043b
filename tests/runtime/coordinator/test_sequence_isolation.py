"""One sequence's failure on a stage fails that sequence alone: the link stays up, the stage
reports which sequence failed, and every other sequence goes on to the same tokens it would
have had. A real stage worker on the embedded model, a real channel, the real wire."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.protocol.control import Ack, Configure, Release
from mlxppd.core.protocol.pipeline import SequenceFailure
from mlxppd.core.stages import StageSpec
from mlxppd.engine.tokenizer import load_tokenizer
from mlxppd.runtime.backends.contract import SamplingParams, SequenceFailed
from mlxppd.runtime.node_start import CoordinatorSetup, start_pipeline_coordinator
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport
from mlxppd.wire.codec import MessageKind
from tests.support.node_keys import node_key_for
from tests.support.pipelines import CLUSTER_TOML, stage_worker
from tests.support.stage_peer import PROMPT, Peer
from tests.support.wire import CLUSTER, SECRET, config, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_LAYERS = 30


def test_a_sequence_whose_forward_raises_fails_alone(embedded_model_dir: Path) -> None:
    async def scenario() -> None:
        mlx = MlxThread("isolation-mlx")
        worker = await stage_worker(embedded_model_dir, mlx, StageSpec(0, 1, 0, NUM_LAYERS))
        host, port = await worker.start("127.0.0.1", 0)
        client = create_transport("tcp", config("coordinator"))
        channel = await client.connect(host, port, expected_peer="stage-0")
        peer = Peer(channel)
        try:
            assert (await peer.control.ask(Configure(), Ack)).ok
            await peer.admit("alone")
            reference = await peer.greedy("alone", 3)
            await peer.control.tell(Release(seq="alone"))

            await peer.admit("good")
            await peer.admit("bad")
            # Stage 0 takes token ids; a 3-D float tensor makes the family's forward raise.
            await peer.send("bad", 0, np.zeros((1, 2, 3), dtype=np.float32))
            await peer.send("bad", 1, np.asarray([PROMPT], dtype=np.int32))  # skipped now
            failure = await peer.data.get()
            assert failure.kind is MessageKind.ERROR
            reported = SequenceFailure.model_validate(dict(failure.meta))
            assert (reported.seq, reported.stage) == ("bad", 0)
            assert reported.message

            # The same link goes on serving: the good sequence gets the tokens it had alone.
            assert await peer.greedy("good", 3) == reference
            assert not channel.closed and worker.stats.sequence_failures == 1
            assert worker.stats.protocol_errors == 0
        finally:
            await channel.close()
            peer.reader.cancel()
            await asyncio.gather(peer.reader, return_exceptions=True)
            await worker.close()
            mlx.close()

    run(scenario)


TRIGGER = 13  # a prompt holding this token id makes stage 0's forward raise (injected fault)


def test_a_request_whose_stage_fails_gets_an_error_and_the_others_their_tokens(
    embedded_model_dir: Path,
) -> None:
    """Two stages and the coordinator, in one process over real sockets. Stage 0's forward
    raises for one request's input (a fault injected into the family's forward); that request
    fails with SequenceFailed, the one beside it gets exactly the tokens it gets alone."""

    async def scenario() -> None:
        mlx = MlxThread("isolation-mlx")
        workers = [
            await stage_worker(embedded_model_dir, mlx, StageSpec(i, 2, start, end))
            for i, (start, end) in enumerate([(0, 15), (15, NUM_LAYERS)])
        ]
        first = workers[0].runner
        forward = first.forward

        def faulty(seq: str, x: Any) -> Any:
            if TRIGGER in np.array(x).ravel().tolist():
                raise RuntimeError("injected fault in the family's forward")
            return forward(seq, x)

        first.forward = faulty  # type: ignore[method-assign]
        ports = [(await w.start("127.0.0.1", 0))[1] for w in workers]
        cluster = parse_cluster_config(
            CLUSTER_TOML.format(name=CLUSTER, port0=ports[0], port1=ports[1]), "test.toml"
        )
        setup = CoordinatorSetup(
            cluster=cluster, node_id="coordinator", secret=SECRET, transport="tcp",
            node_key=node_key_for("coordinator"),
            plan=(LayerRange(0, 15), LayerRange(15, NUM_LAYERS)), micro_batch_size=1,
            parallel=8, warmup=False, align=False,
        )  # fmt: skip
        tokenizer = await mlx.run(lambda: load_tokenizer(embedded_model_dir))
        coordinator = await start_pipeline_coordinator(setup, tokenizer, "test", None)
        params = SamplingParams(max_tokens=6)

        async def tokens(name: str, prompt: list[int]) -> list[int]:
            return [e.token async for e in coordinator.generate(name, prompt, params)]

        try:
            alone = await tokens("alone", PROMPT)
            doomed = asyncio.create_task(tokens("doomed", [*PROMPT, TRIGGER, *PROMPT]))
            beside = asyncio.create_task(tokens("beside", PROMPT))
            with pytest.raises(SequenceFailed, match="injected fault"):
                await doomed
            assert await beside == alone
            assert coordinator.health().ready
            assert await tokens("after", PROMPT) == alone
            assert workers[0].stats.sequence_failures == 1
        finally:
            await coordinator.close()
            for worker in workers:
                await worker.close()
            mlx.close()

    run(scenario)


def test_a_stage_whose_coordinator_falls_silent_drops_it_and_frees_its_kv(
    embedded_model_dir: Path,
) -> None:
    """The coordinator asks for heartbeats (configure) and then says nothing more: past the
    timeout the stage closes its channel and frees every sequence it held for it."""

    async def scenario() -> None:
        mlx = MlxThread("heartbeat-mlx")
        worker = await stage_worker(embedded_model_dir, mlx, StageSpec(0, 1, 0, NUM_LAYERS))
        host, port = await worker.start("127.0.0.1", 0)
        channel = await create_transport("tcp", config("coordinator")).connect(
            host, port, expected_peer="stage-0"
        )
        peer = Peer(channel)
        try:
            beats = Configure(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
            assert (await peer.control.ask(beats, Ack)).ok
            await peer.admit("held")
            assert worker.kv.used_bytes > 0
            # This side sends nothing more; the stage closes the channel (the reader ends).
            await asyncio.wait_for(peer.reader, 30)
            deadline = asyncio.get_running_loop().time() + 30
            while worker.kv.used_bytes or worker.kv.reserved:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)
            kinds = [peer.data.get_nowait().kind for _ in range(peer.data.qsize())]
            assert MessageKind.CONTROL in kinds  # its own heartbeats came meanwhile
        finally:
            await channel.close()
            peer.reader.cancel()
            await asyncio.gather(peer.reader, return_exceptions=True)
            await worker.close()
            mlx.close()

    run(scenario)
