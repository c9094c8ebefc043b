"""`mlxppd serve --pp-size N` restarts a stage process that dies, on the same port.

The first test runs the whole command; the others drive ``LocalCluster`` here, with real stage
processes, to reach the give-up and shutdown paths with a fast restart policy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.restart_policy import RestartPolicy
from mlxppd.runtime.local_cluster import LocalCluster
from tests.cluster_support import (
    kill,
    listens_on,
    process_gone,
    restarted_stage_pids,
    stage_port_and_pid,
    start_cluster,
    wait_gone,
)

pytestmark = pytest.mark.slow


def test_a_killed_stage_comes_back_on_its_port_and_stop_leaves_nothing(
    tmp_path: Path, embedded_model_dir: Path, model_cache: Path
) -> None:
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    running = start_cluster(tmp_path, env, "--pp-size", "3")
    new_pids: list[int] = []
    try:
        port, old_pid = stage_port_and_pid(running, 1)
        assert listens_on(old_pid, port)
        kill(old_pid)
        # Generous: only a stage that never comes back runs into the deadline.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            new_pids = restarted_stage_pids(running, 1)
            if new_pids and listens_on(new_pids[-1], port):
                break
            time.sleep(0.2)
        log = running.log()
        assert len(new_pids) == 1 and new_pids[0] != old_pid, log[-3000:]
        assert listens_on(new_pids[0], port), log[-3000:]
        assert process_gone(old_pid)
        assert (
            f"stage 1 (pid {old_pid}) exited with status -9; restarting it on 127.0.0.1:{port}"
            in log
        )
        assert "(restart 1)" in log
        # The restarted stage announced the same address the cluster file gives it.
        assert log.count(f"stage 1 listening on 127.0.0.1:{port}") == 2, log[-3000:]
        # The other stages were left alone.
        assert restarted_stage_pids(running, 0) == restarted_stage_pids(running, 2) == []
        assert not any(process_gone(p) for p in running.stage_pids if p != old_pid)
    finally:
        code = running.stop()
    assert code == 0, running.log()[-3000:]
    assert wait_gone([running.proc.pid, *running.stage_pids, *new_pids]) == [], "left behind"
    # Stopping is not mistaken for a crash: nothing was restarted on the way down.
    assert len(restarted_stage_pids(running, 1)) == 1
    assert "restarting it" not in running.log().split(f"stage 1 listening on 127.0.0.1:{port}")[-1]


@pytest.fixture()
def linked_model(tmp_path: Path, embedded_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The embedded model through links, so a test can take its weights away from new stages."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tmp_path / "model"
    model.mkdir()
    for f in embedded_model_dir.iterdir():
        (model / f.name).symlink_to(f)
    return model


@pytest.fixture()
def make_cluster(linked_model: Path, tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    made: list[LocalCluster] = []

    def make(policy: RestartPolicy) -> LocalCluster:
        ranges = (LayerRange(0, 15), LayerRange(15, 30))
        cluster = LocalCluster(str(linked_model), ranges, restart_policy=policy)
        made.append(cluster)
        cluster.start_stages()
        return cluster

    yield make
    for cluster in made:
        cluster.stop()


async def until(condition: Callable[[], bool], timeout: float = 240.0) -> bool:
    # Generous: only a condition that never comes true runs into the deadline.
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


def test_a_stage_that_keeps_failing_to_start_is_given_up_on(
    make_cluster: Callable[..., LocalCluster],
    linked_model: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    policy = RestartPolicy(first_delay_s=0.05, max_delay_s=0.1, max_failed_starts=3)
    cluster = make_cluster(policy)
    first = [p.pid for p in cluster.procs]

    def gave_up() -> bool:
        return any("not restarting it" in r.getMessage() for r in caplog.records)

    async def scenario() -> bool:
        async with cluster.supervision():
            (linked_model / "model.safetensors").unlink()  # every new stage 1 fails to load
            kill(first[1])
            return await until(gave_up)

    with caplog.at_level(logging.WARNING, logger="mlxppd.local"):
        assert asyncio.run(scenario()), caplog.text
    # The kill, then two restarts that failed: three failed starts in a row.
    assert cluster.restarts == [0, 2]
    assert "after 3 failed starts in a row; not restarting it" in caplog.text
    assert cluster.procs[1].poll() is not None and cluster.procs[0].poll() is None
    restarted = [
        int(p) for p in re.findall(r"restarted stage 1/2 \(pid (\d+)\)", capfd.readouterr().err)
    ]
    assert len(restarted) == 2
    cluster.stop()
    assert wait_gone([*first, *restarted]) == []


def test_leaving_supervision_during_a_backoff_restarts_nothing(
    make_cluster: Callable[..., LocalCluster],
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cluster = make_cluster(RestartPolicy(first_delay_s=3600.0, max_delay_s=3600.0))
    first = [p.pid for p in cluster.procs]

    async def scenario() -> bool:
        async with cluster.supervision():
            kill(first[0])
            return await until(lambda: "restarting it" in caplog.text)

    with caplog.at_level(logging.WARNING, logger="mlxppd.local"):
        assert asyncio.run(scenario()), caplog.text
    cluster.stop()
    assert wait_gone(first) == []
    assert cluster.restarts == [1, 0]  # the restart was due, never carried out
    assert "restarted stage" not in capfd.readouterr().err
