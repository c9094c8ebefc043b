"""A tensor-parallel stage in lock-step: rank 0 runs the stage, the other ranks mirror it.

Rank 0 is the stage as the pipeline sees it: it alone receives from the previous stage, admits,
samples and sends. Every call that runs the layers or changes the caches is first announced to
the other ranks (``MirroredRunner``), which make the same call on their own shard
(``apply``), so every rank runs every forward in the same order and the ``all_sum``s inside the
sharded layers meet. How an announcement travels is the caller's (``announce``: the runtime
sends it on the encrypted transport, ``runtime/stage/tp_stage.py``); this module only says
what to announce and how to make the call.

Why not announce over MLX's ring itself: its receive polls, so a rank waiting there for rank 0's
next call keeps a core busy even while the cluster is idle (measured: about 90% of a core per
waiting rank); a rank waiting on a socket sleeps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from mlxppd.core.protocol.tensor_mirror import MirrorCall, MirrorOp
from mlxppd.engine.sampling import Sampled
from mlxppd.engine.stage import LoadedStage
from mlxppd.engine.stage_runner import RowFailed, StageRunner

__all__ = ["Announce", "CallLog", "MirroredRunner", "apply", "gather_ints", "gather_json"]

#: sends one call (and its input, evaluated) to every other rank, in call order
Announce = Callable[[MirrorCall, mx.array | None], None]


class CallLog(Protocol):
    """Where a follower records the calls it made (the trace's track for its slot)."""

    def begin(self) -> float: ...

    def end(self, op: str, started: float, rows: int) -> None: ...

    def take(self) -> list[dict[str, Any]]: ...


def gather_ints(values: list[int], group: mx.distributed.Group) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), in rank order, on every rank."""
    gathered = mx.distributed.all_gather(mx.array([values], dtype=mx.int64), group=group)
    rows: list[list[int]] = np.array(gathered).tolist()
    return rows


def gather_json(value: Any, group: mx.distributed.Group) -> list[Any]:
    """Every rank's JSON ``value``, rank order, on every rank."""
    data = json.dumps(value, separators=(",", ":")).encode()
    lengths = [row[0] for row in gather_ints([len(data)], group)]
    padded = np.zeros(max(lengths), dtype=np.uint8)
    padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    rows = np.array(mx.distributed.all_gather(mx.array(padded[None, :]), group=group))
    return [json.loads(rows[i, :n].tobytes().decode()) for i, n in enumerate(lengths)]


class MirroredRunner(StageRunner):
    """Rank 0's runner: each call that runs layers or touches caches is announced to the other
    ranks before it runs here. Called on the mlx thread only, like every runner."""

    def __init__(self, stage: LoadedStage, group: mx.distributed.Group, announce: Announce):
        super().__init__(stage)
        self.group = group
        self._announce = announce
        # A call made from inside another (keep releases its sequence) is the follower's too.
        self._depth = 0
        #: another rank is gone (its link closed, or the ring failed under a call): this stage
        #: cannot compute again until its ranks start again together
        self.broken = False

    def _mirrored(self, call: MirrorCall, x: mx.array | None, run: Callable[[], Any]) -> Any:
        self._depth += 1
        try:
            if self._depth == 1:
                if self.broken:
                    raise RuntimeError("a tensor-parallel rank of this stage is gone")
                self._announce(call, x)
            return run()
        except RuntimeError as exc:
            self.broken = self.broken or str(exc).startswith("[ring]")
            raise
        finally:
            self._depth -= 1

    def forward(self, seq: str, x: mx.array) -> mx.array:
        call = MirrorCall(mirror=MirrorOp.FORWARD, seq=seq)
        return self._mirrored(call, x, lambda: StageRunner.forward(self, seq, x))

    def forward_and_sample(self, seq: str, x: mx.array, logprobs: bool) -> Sampled:
        call = MirrorCall(mirror=MirrorOp.FORWARD, seq=seq)
        return self._mirrored(
            call, x, lambda: StageRunner.forward_and_sample(self, seq, x, logprobs)
        )

    def forward_group(
        self, group_id: str, seqs: list[str], x: mx.array, head: bool = True
    ) -> mx.array:
        call = MirrorCall(mirror=MirrorOp.FORWARD_GROUP, group=group_id, seqs=seqs)
        return self._mirrored(
            call, x, lambda: StageRunner.forward_group(self, group_id, seqs, x, head)
        )

    def forward_group_and_sample(
        self, group_id: str, seqs: list[str], x: mx.array, logprobs: bool
    ) -> list[Sampled | RowFailed]:
        call = MirrorCall(mirror=MirrorOp.FORWARD_GROUP, group=group_id, seqs=seqs)
        return self._mirrored(
            call,
            x,
            lambda: StageRunner.forward_group_and_sample(self, group_id, seqs, x, logprobs),
        )

    def fork(self, source: str, seq: str) -> None:
        call = MirrorCall(mirror=MirrorOp.FORK, source=source, seq=seq)
        self._mirrored(call, None, lambda: StageRunner.fork(self, source, seq))

    def keep(self, seq: str, entry: str, tokens: int) -> bool:
        call = MirrorCall(mirror=MirrorOp.KEEP, seq=seq, entry=entry, tokens=tokens)
        return bool(self._mirrored(call, None, lambda: StageRunner.keep(self, seq, entry, tokens)))

    def start_from(self, entry: str, seq: str, tokens: int) -> None:
        call = MirrorCall(mirror=MirrorOp.START_FROM, entry=entry, seq=seq, tokens=tokens)
        self._mirrored(call, None, lambda: StageRunner.start_from(self, entry, seq, tokens))

    def forget(self, entry: str) -> None:
        call = MirrorCall(mirror=MirrorOp.FORGET, entry=entry)
        self._mirrored(call, None, lambda: StageRunner.forget(self, entry))

    def release_all(self) -> None:
        call = MirrorCall(mirror=MirrorOp.RELEASE_ALL)
        self._mirrored(call, None, lambda: StageRunner.release_all(self))

    def release(self, seq: str) -> bool:
        call = MirrorCall(mirror=MirrorOp.RELEASE, seq=seq)
        return bool(self._mirrored(call, None, lambda: StageRunner.release(self, seq)))

    def follower_events(self) -> list[dict[str, Any]]:
        """The trace events the other ranks recorded since they were last asked."""
        call = MirrorCall(mirror=MirrorOp.TRACE)
        gathered = self._mirrored(call, None, lambda: gather_json([], self.group))
        return [e for events in gathered[1:] for e in events]


def apply(
    runner: StageRunner,
    call: MirrorCall,
    x: mx.array | None,
    group: mx.distributed.Group,
    log: CallLog,
) -> None:
    """A rank other than 0: make the call rank 0 announced, on this rank's shard. The output
    head is rank 0's alone (it samples): a follower runs the layers only. Raises what the call
    raises (it raised on rank 0 too: same state, same input)."""
    op = call.mirror
    started = log.begin()
    if op is MirrorOp.TRACE:
        gather_json(log.take(), group)
        return
    if op in (MirrorOp.FORWARD, MirrorOp.FORWARD_GROUP) and x is None:
        raise ValueError(f"{op.name} without its input tensor")
    if op is MirrorOp.FORWARD and x is not None:
        runner.forward(str(call.seq), x)
    elif op is MirrorOp.FORWARD_GROUP and x is not None:
        runner.forward_group(str(call.group), list(call.seqs or ()), x, head=False)
    elif op is MirrorOp.FORK:
        runner.fork(str(call.source), str(call.seq))
    elif op is MirrorOp.KEEP:
        runner.keep(str(call.seq), str(call.entry), int(call.tokens or 0))
    elif op is MirrorOp.START_FROM:
        runner.start_from(str(call.entry), str(call.seq), int(call.tokens or 0))
    elif op is MirrorOp.FORGET:
        runner.forget(str(call.entry))
    elif op is MirrorOp.RELEASE_ALL:
        runner.release_all()
    elif op is MirrorOp.RELEASE:
        runner.release(str(call.seq))
    if x is not None:
        log.end(op.name.lower(), started, rows=int(x.shape[0]))
