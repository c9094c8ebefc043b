"""After the first loss: five hosts (network namespaces) under ``mlxppd agent``, a coordinator,
three stages and a standby, with the cluster file's layout restored once lost nodes return.
The scenarios run in order on one cluster:

1. a request caught in its admission (the stage it waits on is hung, then killed) is replayed
   on the new pipeline instead of refused;
2. a second stage killed while the first recovery waits for the first: the recovery starts
   again on the survivors left (stage 0 and the standby);
3. both lost nodes return: the coordinator puts the file's nodes and layers back by itself,
   under streams that run the whole time.

Every greedy stream ends with exactly single-process mlx-lm's text, and no KV stays held.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agents import netns_unavailable
from tests.support.failover_hosts import (
    QUESTIONS,
    Cluster,
    check,
    finished,
    running_cluster,
    specs,
    wait_file,
)
from tests.support.references import greedy_answers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

_WHY = netns_unavailable()
if _WHY is not None:
    pytest.skip(f"the failover tests need network namespaces: {_WHY}", allow_module_level=True)

# Long enough that a hung stage is lost when it is killed (a closed link), not by its
# silence before the request under test reached it: no scenario here waits for a timeout.
TIMEOUT_S = 20.0
GRACE_S = 12.0
RESTORE = "restore_layout = true\nrestore_after_s = 3.0\nrestore_drain_s = 0.5"
FILE_LAYOUT = [("stage-0", "0-9"), ("stage-1", "10-19"), ("stage-2", "20-29")]


#: tokens per stream: the fault lands after the ``AFTER``-th, mid-stream
TOKENS = 12
AFTER = 6
#: the restore's back-to-back streams: three lengths, so their ends never line up (a restore
#: whose drain caught them all between two requests would have none to pause)
LOOPS = [{"q": q, "n": n, "sampling": {"temperature": 0}}
         for q, n in zip(QUESTIONS, (TOKENS, 8, 16), strict=False)]  # fmt: skip


@pytest.fixture(scope="module")
def reference(embedded_model_dir: Path) -> dict[tuple[str, int], str]:
    """Single-process mlx-lm's greedy answers."""
    asks = {(q, TOKENS) for q in QUESTIONS[:2]} | {(s["q"], s["n"]) for s in LOOPS}
    return greedy_answers(embedded_model_dir, sorted(asks))


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path, model_cache: Path
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("failover-cascade")
    yield from running_cluster(root, model_cache, TIMEOUT_S, GRACE_S, RESTORE)


def wait_metric(cluster: Cluster, pattern: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while re.search(pattern, cluster.metrics(), re.M) is None:
        assert time.monotonic() < deadline, f"no {pattern!r} in the metrics"
        time.sleep(0.05)


def layout(document: dict[str, object]) -> list[tuple[str, str]]:
    stages = document["stages"]
    assert isinstance(stages, list)
    return [(s["node_id"], s["layers"]) for s in stages]


def test_a_request_caught_in_its_admission_by_a_lost_stage_is_replayed(
    cluster: Cluster, reference: dict[tuple[str, int], str]
) -> None:
    """Stage 1 hangs (SIGSTOP), so a new request's admission waits for its answer; the stage
    is then killed and restarted: the request is admitted again on the reconnected pipeline
    and streams the reference text (it used to get a 503)."""
    mark = len(cluster.coordinator_log())
    victim = cluster.agents[2]
    os.kill(victim.process.pid, signal.SIGSTOP)
    want = specs(TOKENS, 1)
    proc, _ = cluster.streams(want)
    # Past its slot, so in its admission: no stage can answer it before stage 1 does.
    wait_metric(cluster, r"^mlxpp_active_sequences 1(\.0)?$")
    os.kill(victim.process.pid, signal.SIGKILL)
    cluster.restart(2)
    check(finished(proc), want, reference, logs=cluster.logs())
    # Reconnected, or (on a slow host) the standby took over until the layout came back.
    cluster.wait_log(r"failover: (reconnected|standby) after [\d.]+ s: .*; 1 sequences "
                     r"replayed", mark)  # fmt: skip
    cluster.wait_status(lambda d: layout(d) == FILE_LAYOUT)
    cluster.wait_idle()


def test_a_second_stage_killed_while_the_first_recovery_runs_restarts_it(
    cluster: Cluster, reference: dict[tuple[str, int], str]
) -> None:
    """Stage 1's host dies mid-stream; while the recovery waits out its grace, stage 2's dies
    too: the recovery starts again on stage 0, the standby joins it, and every stream ends
    unchanged."""
    mark = len(cluster.coordinator_log())
    want = specs(TOKENS, 2)
    proc, signalled = cluster.streams(want, cluster.agents[2].process.pid, AFTER)
    wait_file(signalled)
    cluster.wait_log(r"coordinator: lost stage 1 \(stage-1\)", mark)
    os.kill(cluster.agents[3].process.pid, signal.SIGKILL)
    check(finished(proc), want, reference, logs=cluster.logs())
    cluster.wait_log(r"failover: stage 2 \(stage-2\) lost too while recovering; pass 2 builds "
                     r"on stage-0", mark)  # fmt: skip
    cluster.wait_log(r"failover: standby after [\d.]+ s: stages 1 \(stage-1\) and 2 \(stage-2\) "
                     r"were lost; 1 survivors and standby standby-0 now hold 0-\d+, \d+-29; 2 "
                     r"sequences replayed", mark)  # fmt: skip
    document = cluster.wait_status(
        lambda d: [s["node_id"] for s in d["stages"]] == ["stage-0", "standby-0"]
    )
    assert document["coordinator"]["failovers"][-1]["outcome"] == "standby"
    cluster.wait_idle()


def test_the_lost_nodes_return_and_the_files_layout_comes_back_by_itself(
    cluster: Cluster, reference: dict[tuple[str, int], str]
) -> None:
    """Streams run back to back the whole time; both lost hosts' agents start again. Once
    they have answered for restore_after_s the coordinator restores stage-0, stage-1 and
    stage-2 with the file's layers, pausing the streams it catches and replaying them."""
    mark = len(cluster.coordinator_log())
    want = LOOPS
    proc, stop = cluster.loops(want)
    cluster.restart(2, 3)
    found = cluster.wait_log(
        r"failover: restored the cluster file's layout after [\d.]+ s: stage-0, stage-1, "
        r"stage-2 hold 0-9, 10-19, 20-29; (\d+) sequences replayed", mark,
    )  # fmt: skip
    document = cluster.wait_status(lambda d: layout(d) == FILE_LAYOUT)
    assert document["coordinator"]["ready"]
    stop.touch()
    rounds = finished(proc)
    for results, spec in zip(rounds, want, strict=True):
        assert results, spec
        check(results, [spec] * len(results), reference, logs=cluster.logs())
    # The restore drained for restore_drain_s, then paused what still ran (streams of three
    # lengths, back to back, are never all between two requests).
    assert int(found.group(1)) >= 1, cluster.coordinator_log()[mark:][-6000:]
    cluster.wait_idle()
