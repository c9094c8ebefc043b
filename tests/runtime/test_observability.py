"""Metrics, traces and OOM diagnostics of a live local cluster, scraped like Prometheus would."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.clusters import RunningCluster, start_cluster
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
KV_BUDGET = 8_000_000  # one request of ~240 tokens fits per stage, a 1,000-token prompt does not


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, cli_env_module: dict[str, str]
) -> Iterator[tuple[RunningCluster, Path, Path]]:
    tmp = tmp_path_factory.mktemp("observed")
    trace = tmp / "trace.json"
    metrics_ready = tmp / "metrics.ready"
    running = start_cluster(
        tmp, cli_env_module, "--pp-size", "2", "--metrics", "--metrics-port", "0",
        "--metrics-ready-file", str(metrics_ready), "--debug-pp-trace", str(trace),
        "--kv-budget-bytes", str(KV_BUDGET),
    )  # fmt: skip
    yield running, trace, metrics_ready
    running.stop()


@pytest.fixture(scope="module")
def cli_env_module(model_cache: Path, embedded_model_dir: Path) -> dict[str, str]:
    import os

    return {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}


def ask(url: str, text: str, max_tokens: int = 8) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return httpx.post(f"{url}/v1/chat/completions", json={**body, "temperature": 0}, timeout=300)


def scrape(url: str) -> dict[str, float]:
    """Every sample of the exposition: 'name{labels}' -> value."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    matches = [
        v for k, v in samples.items()
        if k.split("{")[0] == name and all(w in k for w in want)
    ]  # fmt: skip
    assert matches, f"{name} {labels} not exported"
    return sum(matches)


def scrape_when(
    url: str, ready: Callable[[dict[str, float]], bool], timeout: float = 120
) -> dict[str, float]:
    """Scrape until ``ready`` holds (the coordinator polls every stage once a second, so the
    stages' numbers lag); after ``timeout`` the last scrape, for the caller's assertions."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        with contextlib.suppress(AssertionError):  # a metric not exported yet
            if ready(samples):
                return samples
        if time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def test_scrape_after_real_requests_has_plausible_values(
    traced: tuple[RunningCluster, Path, Path],
) -> None:
    running, _, _ = traced
    threads = [threading.Thread(target=ask, args=(running.url, q)) for q in ("Hi", "Count to 3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    pair = {"src_stage": "0", "dst_stage": "1"}
    first = scrape_when(
        running.url,
        lambda s: (
            value(s, "mlxpp_pp_activation_latency_seconds_count", **pair) > 0
            and value(s, "mlxpp_pp_stage_busy_seconds_total", stage="1") > 0
        ),
    )
    for stage in ("0", "1"):
        assert 0.0 <= value(first, "mlxpp_pp_stage_busy_fraction", stage=stage) <= 1.0
        assert 0.0 <= value(first, "mlxpp_pp_stage_bubble_fraction", stage=stage) <= 1.0
        assert value(first, "mlxpp_kv_budget_bytes", stage=stage) == KV_BUDGET
    assert 0.0 <= value(first, "mlxpp_pp_mean_bubble_ratio") <= 1.0
    assert value(first, "mlxpp_pp_stage_busy_seconds_total", stage="1") > 0
    count = value(first, "mlxpp_pp_activation_latency_seconds_count", **pair)
    assert count > 0
    # Seconds, not milliseconds: a loopback hop takes far less than a minute even on a busy
    # machine (the bound only catches a unit error, never a slow run).
    assert 0 < value(first, "mlxpp_pp_activation_latency_seconds_max", **pair) < 60
    assert value(first, "mlxpp_generation_tokens_total") >= 16
    assert value(first, "mlxpp_time_to_first_token_seconds_count") >= 2
    assert value(first, "mlxpp_http_requests_total", status="200") >= 2

    ask(running.url, "One more, please")
    second = scrape_when(
        running.url,
        lambda s: value(s, "mlxpp_pp_activation_latency_seconds_count", **pair) > count,
    )
    assert value(second, "mlxpp_pp_activation_latency_seconds_count", **pair) > count


def test_a_forced_rejection_is_counted_logged_and_explained(
    traced: tuple[RunningCluster, Path, Path],
) -> None:
    running, _, _ = traced
    rejected = ask(running.url, "word " * 1000)
    # More than a stage's whole budget: a 400 (retrying cannot help), still counted as a rejection.
    assert rejected.status_code == 400
    error = rejected.json()["error"]
    assert error["code"] == "context_length_exceeded"
    for key in ("stage", "reason", "used_bytes", "budget_bytes", "active_sequences"):
        assert key in error
    samples = scrape(running.url)
    assert value(samples, "mlxpp_pp_admission_rejections_total", reason="memory") >= 1
    assert re.search(r"admission rejected: .* stage=\d reason=memory required=\d+", running.log())


def test_metrics_port_serves_the_same_registry(traced: tuple[RunningCluster, Path, Path]) -> None:
    running, _, metrics_ready = traced
    separate = metrics_ready.read_text().strip()
    assert separate != running.url
    text = httpx.get(f"{separate}/metrics", timeout=30).text
    assert "mlxpp_pp_stage_busy_fraction" in text


def test_every_dashboard_query_uses_exported_metrics(
    traced: tuple[RunningCluster, Path, Path],
) -> None:
    running, _, _ = traced
    # Families declared by the exposition (a labelled counter with no samples yet still counts).
    text = httpx.get(f"{running.url}/metrics", timeout=30).text
    exported = {key.split("{")[0] for key in scrape(running.url)}
    suffixes = {"counter": ("",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count"), "gauge": ("",)}  # fmt: skip
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        exported |= {name + s for s in suffixes.get(kind, ("",))}
    dashboard = json.loads((REPO / "docs/grafana/mlxpp-pipeline.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"mlxpp_[a-z0-9_]+", e)}
    assert used and used <= exported, used - exported


def test_exposition_passes_promtool(traced: tuple[RunningCluster, Path, Path]) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package 'prometheus')")
    running, _, _ = traced
    text = httpx.get(f"{running.url}/metrics", timeout=30).text
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_trace_has_every_event_kind_and_stage_spans_do_not_overlap(
    traced: tuple[RunningCluster, Path, Path],
) -> None:
    running, trace, _ = traced
    assert running.stop() == 0, running.log()
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events}
    for kind in (
        "batch_arrival",
        "stage",
        "activation_send",
        "activation_recv",
        "admission_reject",
    ):
        assert kind in names
    assert {e["pid"] for e in events} >= {"coordinator", "stage-0", "stage-1"}
    reject = next(e for e in events if e["name"] == "admission_reject")
    for key in ("reason", "required_bytes", "available_bytes"):
        assert key in reject["args"]
    sends = [e for e in events if e["name"] == "activation_send"]
    assert all(e["args"]["bytes"] > 0 and e["args"]["direction"] == "send" for e in sends)
    spans: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for e in events:
        if e["name"] == "stage":
            spans.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert len(spans) == 2
    for intervals in spans.values():
        intervals.sort()
        assert all(
            a_end <= b_start
            for (_, a_end), (b_start, _) in zip(intervals, intervals[1:], strict=False)
        )
    # Written once: the file is complete JSON and not rewritten by a second flush.
    mtime = trace.stat().st_mtime_ns
    time.sleep(0.1)
    assert trace.stat().st_mtime_ns == mtime
