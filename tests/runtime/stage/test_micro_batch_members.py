"""A micro-batch step that names a sequence the stage no longer holds runs for the others:
the stale member is dropped from that step and reported alone, its caches are not made again,
and the members beside it get exactly the tokens they get alone. (A Release that overtook a
step failed the whole group: the soak's lost requests after an early client close.) A real
stage worker on the embedded model, over a real channel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlxppd.core.protocol.control import Release
from mlxppd.core.protocol.pipeline import BatchTokenMeta, SequenceFailure
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.codec import Message, MessageKind
from tests.support.stage_peer import connected
from tests.support.wire import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_LAYERS = 30


def batch_tokens(message: Message) -> dict[str, int]:
    assert message.kind is MessageKind.TOKENS, message.meta
    meta = BatchTokenMeta.model_validate(dict(message.meta))
    tokens = np.frombuffer(message.tensor.data, dtype=np.int32).tolist()
    return dict(zip(meta.seqs, tokens, strict=True))


def failure(message: Message) -> SequenceFailure:
    assert message.kind is MessageKind.ERROR, message.meta
    return SequenceFailure.model_validate(dict(message.meta))


def test_a_released_member_is_dropped_from_its_step_and_the_others_go_on(
    embedded_model_dir: Path,
) -> None:
    async def scenario() -> None:
        mlx = MlxThread("members-mlx")
        worker, peer = await connected(embedded_model_dir, mlx, NUM_LAYERS)
        try:
            await peer.admit("alone")
            alone = await peer.greedy("alone", 3)
            await peer.control.tell(Release(seq="alone"))

            for seq in ("a", "b"):
                await peer.admit(seq)
            first = {seq: await peer.prefill(seq) for seq in ("a", "b")}
            await peer.send_group("g0", ["a", "b"], 0, [first["a"], first["b"]])
            second = batch_tokens(await peer.data.get())
            # b's client closed: its release reaches the stage before the step carrying it.
            await peer.control.tell(Release(seq="b"))
            await peer.send_group("g0", ["a", "b"], 1, [second["a"], second["b"]])
            messages = [await peer.data.get(), await peer.data.get()]
            errors = [failure(m) for m in messages if m.kind is MessageKind.ERROR]
            tokens = [batch_tokens(m) for m in messages if m.kind is MessageKind.TOKENS]

            assert [e.seq for e in errors] == ["b"]
            assert "not held" in errors[0].message
            assert len(tokens) == 1 and list(tokens[0]) == ["a"]
            assert [first["a"], second["a"], tokens[0]["a"]] == alone
            assert worker.stats.stale_steps == 1
            assert not peer.channel.closed
        finally:
            await peer.close()
            await worker.close()
            mlx.close()

    run(scenario)


def test_a_decode_step_of_a_released_sequence_makes_no_caches(embedded_model_dir: Path) -> None:
    async def scenario() -> None:
        mlx = MlxThread("members-mlx")
        worker, peer = await connected(embedded_model_dir, mlx, NUM_LAYERS)
        try:
            await peer.admit("gone")
            token = await peer.prefill("gone")
            await peer.control.tell(Release(seq="gone"))
            # The step that was already on its way arrives after the release.
            await peer.send("gone", 1, np.asarray([[token]], dtype=np.int32))
            reported = failure(await peer.data.get())
            assert reported.seq == "gone" and "not held" in reported.message
            assert worker.runner is not None and worker.runner.active == 0
            assert not worker.kv.reserved
        finally:
            await peer.close()
            await worker.close()
            mlx.close()

    run(scenario)
