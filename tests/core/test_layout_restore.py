"""When the cluster file's layout comes back after a failover: the nodes it lacks must keep
answering for a while, and nothing may hold admissions (``core/layout_restore.py``), with the
caller's clock injected."""

from __future__ import annotations

from mlxppd.core.layout_restore import MAX_WAIT_S, RestoreWatch, drain_over, missing_nodes

FILE = ("stage-0", "stage-1", "stage-2")


def test_only_a_pipeline_on_other_nodes_than_the_files_is_restored() -> None:
    assert missing_nodes(FILE, FILE) == ()
    assert missing_nodes(("stage-0", "stage-2"), FILE) == ("stage-1",)
    assert missing_nodes(("stage-0", "stage-1", "standby-0"), FILE) == ("stage-2",)
    assert missing_nodes(("stage-0",), FILE) == ("stage-1", "stage-2")


def test_the_missing_nodes_must_answer_for_the_whole_wait() -> None:
    watch = RestoreWatch(after_s=30.0)
    watch = watch.observe(("stage-1",), answered=True, now=100.0)
    assert watch.answering_since == 100.0
    watch = watch.observe(("stage-1",), answered=True, now=102.0)
    assert watch.answering_since == 100.0  # still the first answer
    assert not watch.due(now=129.9, held=False)
    assert watch.due(now=130.0, held=False)


def test_a_miss_starts_the_wait_again() -> None:
    watch = RestoreWatch(after_s=30.0).observe(("stage-1",), True, 100.0)
    watch = watch.observe(("stage-1",), answered=False, now=120.0)
    assert watch.answering_since is None and not watch.due(now=500.0, held=False)
    watch = watch.observe(("stage-1",), answered=True, now=125.0)
    assert not watch.due(now=150.0, held=False) and watch.due(now=155.0, held=False)


def test_another_loss_starts_the_wait_again_for_the_new_set() -> None:
    watch = RestoreWatch(after_s=30.0).observe(("stage-1",), True, 100.0)
    watch = watch.observe(("stage-1", "stage-2"), answered=True, now=128.0)
    assert watch.answering_since == 128.0 and not watch.due(now=131.0, held=False)


def test_held_admissions_put_the_restore_off() -> None:
    watch = RestoreWatch(after_s=30.0).observe(("stage-1",), True, 100.0)
    assert not watch.due(now=200.0, held=True)
    assert watch.due(now=200.0, held=False)


def test_nothing_missing_is_never_due() -> None:
    watch = RestoreWatch(after_s=1.0).observe((), answered=True, now=100.0)
    assert watch.answering_since is None and not watch.due(now=1e9, held=False)


def test_the_drain_ends_when_nothing_runs_or_its_time_is_up() -> None:
    assert drain_over(active=0, started=100.0, now=100.0, drain_s=30.0)
    assert not drain_over(active=2, started=100.0, now=129.0, drain_s=30.0)
    assert drain_over(active=2, started=100.0, now=130.0, drain_s=30.0)


def test_a_restore_that_did_not_bring_the_layout_back_doubles_the_next_wait() -> None:
    watch = RestoreWatch(after_s=30.0).observe(("stage-1",), True, 100.0)
    watch = watch.failed()
    assert (watch.failures, watch.wait_s, watch.answering_since) == (1, 60.0, None)
    watch = watch.observe(("stage-1",), True, 200.0)
    assert not watch.due(now=259.0, held=False) and watch.due(now=260.0, held=False)
    assert watch.failed().failed().wait_s == 240.0


def test_the_back_off_is_bounded_and_forgotten_when_other_nodes_go_missing() -> None:
    watch = RestoreWatch(after_s=30.0, missing=("stage-1",), failures=20)
    assert watch.wait_s == MAX_WAIT_S
    watch = watch.observe(("stage-1", "stage-2"), True, 100.0)
    assert (watch.failures, watch.wait_s, watch.answering_since) == (0, 30.0, 100.0)
