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

from mlxppd.core.config.ports import parse_port_range
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.restart_policy import RestartPolicy
from mlxppd.runtime.local_cluster import LocalCluster
from tests.support.clusters import (
    kill,
    wait_gone,
)

pytestmark = pytest.mark.slow


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
        # The test worker's own range, as `serve --pp-size` would take it (tests/conftest.py).
        ports = parse_port_range(os.environ.get("MLXPP_TRANSPORT_PORT_RANGE", "39600-39629"))
        cluster = LocalCluster(str(linked_model), ranges, restart_policy=policy, port_range=ports)
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
