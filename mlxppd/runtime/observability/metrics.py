"""Prometheus metrics of a serving node: one registry passed in, never the global one.

Request-level families are updated where requests are handled; stage-level families come from
the stages' own reports, which the coordinator polls, so one scrape of the coordinator covers
the whole cluster. Busy and bubble fractions are computed over the last ``window_s`` seconds of
those reports; durations are in seconds, Prometheus's base unit.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mlxppd.core.protocol.control import StageReport, WireCounters
from mlxppd.core.stage_accounting import LATENCY_BUCKETS, fractions

_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class _StageHistory:
    """(monotonic poll time, report) pairs within the window, oldest first."""

    reports: collections.deque[tuple[float, StageReport]] = field(default_factory=collections.deque)


@dataclass(frozen=True)
class StageView:
    """A stage's latest report and its busy / bubble fractions over the window."""

    report: StageReport
    busy_fraction: float
    bubble_fraction: float


class PipelineMetrics:
    def __init__(self, registry: CollectorRegistry, *, window_s: float = 10.0) -> None:
        self.registry = registry
        self.window_s = window_s
        r = registry
        self.requests = Counter(
            "mlxpp_http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("mlxpp_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("mlxpp_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "mlxpp_time_to_first_token_seconds", "Time from admission request to first token",
            buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "mlxpp_inter_token_latency_seconds", "Time between consecutive tokens of a sequence",
            buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "mlxpp_pp_admission_rejections", "KV admission rejections by stage and reason",
            ["stage", "reason"], registry=r,
        )  # fmt: skip
        self.repartition_events = Counter(
            "mlxpp_pp_repartition_events", "Elastic repartition state transitions",
            ["trigger", "outcome"], registry=r,
        )  # fmt: skip
        self.repartition_drain = Summary(
            "mlxpp_pp_repartition_drain_seconds", "Drain phase of repartitions", registry=r
        )
        self.repartition_drain_max = Gauge(
            "mlxpp_pp_repartition_drain_seconds_max", "Longest drain phase", registry=r
        )
        self.repartition_total = Summary(
            "mlxpp_pp_repartition_total_seconds", "Whole repartitions", registry=r
        )
        self.config_reload_failures = Counter(
            "mlxpp_config_reload_failures", "Config reloads that failed to load", registry=r
        )
        self.admin_auth_failures = Counter(
            "mlxpp_admin_auth_failures",
            "Admin API requests refused for their signature",
            ["reason"],
            registry=r,
        )
        self._http_families(r)
        self.failovers = Counter(
            "mlxpp_pp_failovers", "Lost stages, by how the pipeline recovered",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.failover_seconds = Histogram(
            "mlxpp_pp_failover_recovery_seconds",
            "From a stage's loss to the new pipeline (or to giving up)",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.sequences_replayed = Counter(
            "mlxpp_pp_sequences_replayed",
            "In-flight sequences prefilled again on a recovered pipeline",
            registry=r,
        )
        self._stages: dict[int, _StageHistory] = {}
        self._queue_depth: Callable[[], int] = lambda: 0
        self._active: Callable[[], int] = lambda: 0
        self._wire: Callable[[], dict[str, Any]] = dict
        self._rdma_fallbacks: Callable[[], int] = lambda: 0
        registry.register(_StageCollector(self))

    def _http_families(self, r: CollectorRegistry) -> None:
        """What the HTTP listeners cut, refuse and hold (``http/``, ``app/http_site.py``)."""
        self.http_cut = Counter(
            "mlxpp_http_connections_cut",
            "HTTP connections cut: a deadline passed, a stream's reader stopped, a client reset",
            ["reason"],
            registry=r,
        )
        self.http_rejected = Counter(
            "mlxpp_http_rejected",
            "HTTP requests refused before a handler: malformed, a reset mid-request, a failure",
            ["reason"],
            registry=r,
        )
        self.sequences_in_flight = Gauge(
            "mlxpp_http_sequences_in_flight",
            "Sequences (choices of n included) the HTTP APIs have admitted and not finished",
            registry=r,
        )
        self.sequences_waiting = Gauge(
            "mlxpp_http_sequences_waiting",
            "Requests waiting for room among the sequences in flight (the pipeline is full)",
            registry=r,
        )
        self.sequences_refused = Counter(
            "mlxpp_http_sequences_refused",
            "Requests refused by the sequence cap: over_share (the client holds its share), "
            "too_many (more than one client may hold), queue_full, queue_timeout",
            ["reason"],
            registry=r,
        )

    def bind(
        self,
        *,
        queue_depth: Callable[[], int],
        active: Callable[[], int],
        wire: Callable[[], dict[str, Any]],
        rdma_fallbacks: Callable[[], int],
    ) -> None:
        """Where the live gauges read from (the coordinator and its transport)."""
        self._queue_depth, self._active = queue_depth, active
        self._wire, self._rdma_fallbacks = wire, rdma_fallbacks

    def record_failover(self, event: Any) -> None:
        """One lost stage (a ``runtime.coordinator.recovery.FailoverEvent``)."""
        self.failovers.labels(outcome=event.outcome).inc()
        self.failover_seconds.observe(event.seconds)

    def record_stage_reports(self, now: float, reports: list[StageReport]) -> None:
        """Keep each stage's reports of the last window (and the one just before it)."""
        for report in reports:
            history = self._stages.setdefault(report.stage, _StageHistory())
            history.reports.append((now, report))
            while len(history.reports) > 2 and history.reports[1][0] < now - self.window_s:
                history.reports.popleft()

    def stage_view(self) -> list[StageView]:
        """Per stage: latest report plus busy / bubble fractions over the window."""
        out = []
        for index in sorted(self._stages):
            reports = self._stages[index].reports
            first, last = reports[0][1], reports[-1][1]
            pair = fractions(first.activity(), last.activity())
            busy, bubble = pair if len(reports) > 1 else (0.0, 0.0)
            out.append(StageView(last, busy, bubble))
        return out


class _StageCollector(Collector):
    def __init__(self, metrics: PipelineMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        stages = self.m.stage_view()
        busy = GaugeMetricFamily(
            "mlxpp_pp_stage_busy_fraction", "Share of the window a stage computed", labels=["stage"]
        )
        bubble = GaugeMetricFamily(
            "mlxpp_pp_stage_bubble_fraction",
            "Share of a stage's active time spent waiting for activations",
            labels=["stage"],
        )
        busy_s = CounterMetricFamily(
            "mlxpp_pp_stage_busy_seconds", "Seconds a stage computed", labels=["stage"]
        )
        active_s = CounterMetricFamily(
            "mlxpp_pp_stage_active_seconds", "Seconds a stage held sequences", labels=["stage"]
        )
        kv_used = GaugeMetricFamily("mlxpp_kv_used_bytes", "KV bytes reserved", labels=["stage"])
        kv_budget = GaugeMetricFamily("mlxpp_kv_budget_bytes", "KV byte budget", labels=["stage"])
        mlx_active = GaugeMetricFamily(
            "mlxpp_stage_mlx_active_bytes",
            "Bytes held by a stage's live mlx arrays",
            labels=["stage"],
        )
        mlx_cache = GaugeMetricFamily(
            "mlxpp_stage_mlx_cache_bytes",
            "Freed bytes a stage's mlx allocator keeps for reuse",
            labels=["stage"],
        )
        latency = HistogramMetricFamily(
            "mlxpp_pp_activation_latency_seconds",
            "Activation hand-off latency from one stage to the next",
            labels=["src_stage", "dst_stage"],
        )
        latency_max = GaugeMetricFamily(
            "mlxpp_pp_activation_latency_seconds_max",
            "Longest activation hand-off",
            labels=["src_stage", "dst_stage"],
        )
        for view in stages:
            s = view.report
            label = [str(s.stage)]
            busy.add_metric(label, view.busy_fraction)
            bubble.add_metric(label, view.bubble_fraction)
            busy_s.add_metric(label, s.busy_s)
            active_s.add_metric(label, s.active_s)
            kv_used.add_metric(label, float(s.kv_used_bytes))
            kv_budget.add_metric(label, float(s.kv_budget_bytes))
            if s.memory is not None:
                mlx_active.add_metric(label, float(s.memory.active_bytes))
                mlx_cache.add_metric(label, float(s.memory.cache_bytes))
            hist = s.activation_latency
            if s.stage > 0 and hist.counts:
                pair = [str(s.stage - 1), str(s.stage)]
                running, buckets = 0, []
                for bound, n in zip((*LATENCY_BUCKETS, float("inf")), hist.counts, strict=True):
                    running += n
                    buckets.append((_le(bound), running))
                latency.add_metric(pair, buckets, hist.sum)
                latency_max.add_metric(pair, hist.max)
        mean = GaugeMetricFamily(
            "mlxpp_pp_mean_bubble_ratio", "Mean bubble fraction over the stages"
        )
        mean.add_metric([], sum(s.bubble_fraction for s in stages) / len(stages) if stages else 0)
        yield from (busy, bubble, mean, busy_s, active_s, kv_used, kv_budget, latency, latency_max)
        yield from (mlx_active, mlx_cache)
        yield from _slots(stages)

        queue = GaugeMetricFamily("mlxpp_queue_depth", "Requests waiting for a free slot")
        queue.add_metric([], self.m._queue_depth())
        active = GaugeMetricFamily("mlxpp_active_sequences", "Sequences generating now")
        active.add_metric([], self.m._active())
        yield from (queue, active)
        yield from self._wire(stages)

    def _wire(self, stages: list[StageView]) -> Iterator[Metric]:
        """The transport's counters, summed over this node and every stage."""
        wire = [WireCounters.model_validate(self.m._wire()), *(s.report.wire for s in stages)]
        handshakes = CounterMetricFamily(
            "mlxpp_transport_handshake_failures", "Transport handshakes that failed, all nodes"
        )
        handshakes.add_metric([], sum(sum(w.handshake_failures.values()) for w in wire))
        rejected = CounterMetricFamily(
            "mlxpp_transport_rejected_frames",
            "Received frames rejected (connection closed), all nodes, by reason",
            labels=["reason"],
        )
        reasons: collections.Counter[str] = collections.Counter()
        for w in wire:
            reasons.update(w.rejected_frames)
        for reason, n in sorted(reasons.items()):
            rejected.add_metric([reason], n)
        preauth = CounterMetricFamily(
            "mlxpp_transport_preauth_refused",
            "Connections closed before their handshake was read (a cap was reached), all "
            "nodes, by reason",
            labels=["reason"],
        )
        refusals: collections.Counter[str] = collections.Counter()
        for w in wire:
            refusals.update(w.preauth_refused)
        for reason, n in sorted(refusals.items()):
            preauth.add_metric([reason], n)
        rekeys = CounterMetricFamily(
            "mlxpp_transport_rekeys",
            "Channel keys replaced on the sending side (REKEY records sent), all nodes",
        )
        rekeys.add_metric([], sum(w.rekeys_sent for w in wire))
        revoked = CounterMetricFamily(
            "mlxpp_transport_revoked_channels",
            "Open channels closed because their peer's key left the roster, all nodes",
        )
        revoked.add_metric([], sum(w.revoked_channels for w in wire))
        fallbacks = CounterMetricFamily("mlxpp_rdma_fallbacks", "RDMA transport fallbacks to TCP")
        fallbacks.add_metric([], self.m._rdma_fallbacks())
        yield from (handshakes, rejected, preauth, rekeys, revoked, fallbacks)


def _slots(stages: list[StageView]) -> Iterator[Metric]:
    """Per (stage, rank) slot: its shard of the weights and its KV (rank 0 alone for a stage
    of one rank), so a 2D cluster's dashboard shows every host of a stage."""
    labels = ["stage", "rank"]
    held = GaugeMetricFamily(
        "mlxpp_slot_parameter_bytes", "Weight bytes a (stage, rank) slot holds", labels=labels
    )
    used = GaugeMetricFamily(
        "mlxpp_slot_kv_used_bytes", "KV bytes reserved on a (stage, rank) slot", labels=labels
    )
    budget = GaugeMetricFamily(
        "mlxpp_slot_kv_budget_bytes", "KV byte budget of a (stage, rank) slot", labels=labels
    )
    for view in stages:
        s = view.report
        rows = [(x.rank, x.parameter_bytes, x.kv_used_bytes, x.kv_budget_bytes) for x in s.slots]
        for rank, nbytes, kv_used, kv_budget in rows or [
            (0, s.parameter_bytes, s.kv_used_bytes, s.kv_budget_bytes)
        ]:
            label = [str(s.stage), str(rank)]
            held.add_metric(label, float(nbytes))
            used.add_metric(label, float(kv_used))
            budget.add_metric(label, float(kv_budget))
    yield from (held, used, budget)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
