"""The console's chart points (pure): rates between two readings of the counters, the mean
time to first token of the requests that got one, a restarted counter counted from zero; the
start timeline keeps its latest marks; the feed bounds its listeners and ends them all when the
server stops."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from mlxppd.core.console_series import Point, Reading, point_between
from mlxppd.http.console_feed import MAX_LISTENERS, ConsoleFeed
from mlxppd.runtime.observability.metrics import PipelineMetrics
from mlxppd.runtime.observability.timeline import MAX_MARKS, StartTimeline


def test_a_point_is_the_rates_over_the_interval() -> None:
    before = Reading(at=100.0, tokens=50, requests=4, ttft_sum=2.0, ttft_count=4)
    after = Reading(at=102.0, tokens=90, requests=6, ttft_sum=3.0, ttft_count=6, busy=((0, 0.5),))
    point = point_between(before, after)
    assert point == Point(at=102.0, tokens_s=20.0, requests_s=1.0, ttft_s=0.5, busy=((0, 0.5),))
    assert point.to_json()["busy"] == {"0": 0.5}


def test_no_first_token_means_no_ttft_and_no_time_means_no_point() -> None:
    quiet = Reading(at=100.0, tokens=0, requests=0, ttft_sum=0.0, ttft_count=0)
    later = Reading(at=101.0, tokens=0, requests=0, ttft_sum=0.0, ttft_count=0)
    point = point_between(quiet, later)
    assert point is not None and point.ttft_s is None and point.tokens_s == 0
    assert point_between(later, later) is None


def test_a_restarted_counter_counts_from_zero() -> None:
    before = Reading(at=100.0, tokens=1000, requests=50, ttft_sum=20.0, ttft_count=50)
    after = Reading(at=101.0, tokens=10, requests=1, ttft_sum=0.2, ttft_count=1)
    point = point_between(before, after)
    assert point is not None and (point.tokens_s, point.requests_s) == (10.0, 1.0)
    assert point.ttft_s == pytest.approx(0.2)


def test_the_timeline_keeps_its_latest_marks() -> None:
    clock = iter(range(1000)).__next__
    timeline = StartTimeline(clock=lambda: float(clock()))
    for i in range(MAX_MARKS + 5):
        timeline.mark(f"step {i}")
    marks = timeline.to_json()
    assert len(marks) == MAX_MARKS and marks[-1] == {
        "at": MAX_MARKS + 4.0,
        "what": f"step {MAX_MARKS + 4}",
    }


def test_the_feed_reads_the_metrics_it_is_given() -> None:
    metrics = PipelineMetrics(CollectorRegistry())
    now = iter([10.0, 12.0]).__next__
    feed = ConsoleFeed(None, metrics, None, clock=now)  # type: ignore[arg-type]
    assert feed.sample() is None  # the first reading has nothing before it
    metrics.generation_tokens.inc(30)
    metrics.requests.labels(endpoint="/v1/chat/completions", status="200").inc(2)
    metrics.requests.labels(endpoint="/console/v1/state", status="200").inc(5)  # not traffic
    metrics.ttft.observe(0.5)
    point = feed.sample()
    assert point is not None and (point.tokens_s, point.requests_s, point.ttft_s) == (15, 1, 0.5)
    assert feed.series() == [point.to_json()]


def test_listeners_are_bounded_and_all_end_when_the_server_stops() -> None:
    async def scenario() -> None:
        feed = ConsoleFeed(None, None, None)  # type: ignore[arg-type]
        queues = [feed.listen() for _ in range(MAX_LISTENERS)]
        assert all(q is not None for q in queues) and feed.listen() is None
        for _ in range(4):  # a slow page's queue is full of ticks
            queues[0].put_nowait({"tick": 1})  # type: ignore[union-attr]
        feed.close()
        for queue in queues:
            assert queue is not None
            while queue.get_nowait() is not None:
                pass  # the end is the last item in every queue
        assert feed.listen() is None  # and no page starts listening to a stopping server

    asyncio.run(scenario())
