"""docs/grafana/mlxpp-pipeline.json is an importable Grafana dashboard over exported metrics only.

The dashboard is a contract with two sides: Grafana must accept the JSON model as is (uid,
schemaVersion, a datasource variable that every panel uses, unique panel ids, a non-overlapping
grid), and every PromQL expression may only name series that the metrics server exposes at
/metrics. The five panels the observability spec asks for must be present and must query their
metric family.
"""

from __future__ import annotations

import json
import re
from itertools import combinations

import pytest

from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(30)

DASHBOARD_PATH = REPO_ROOT / "docs" / "grafana" / "mlxpp-pipeline.json"
DASHBOARD = json.loads(DASHBOARD_PATH.read_text())
PANELS = DASHBOARD["panels"]
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
METRIC_TOKEN = re.compile(r"mlxpp_[a-z0-9_]+")

_HISTOGRAMS = (
    "mlxpp_pp_activation_latency_seconds",
    "mlxpp_time_to_first_token_seconds",
    "mlxpp_inter_token_latency_seconds",
)
_SUMMARIES = (
    "mlxpp_pp_repartition_drain_seconds",
    "mlxpp_pp_repartition_total_seconds",
)
_PLAIN = (
    # gauges
    "mlxpp_pp_stage_busy_fraction",
    "mlxpp_pp_stage_bubble_fraction",
    "mlxpp_pp_mean_bubble_ratio",
    "mlxpp_pp_activation_latency_seconds_max",
    "mlxpp_pp_repartition_drain_seconds_max",
    "mlxpp_queue_depth",
    "mlxpp_active_sequences",
    "mlxpp_kv_used_bytes",
    "mlxpp_kv_budget_bytes",
    "mlxpp_slot_parameter_bytes",
    "mlxpp_slot_kv_used_bytes",
    "mlxpp_slot_kv_budget_bytes",
    # counters
    "mlxpp_pp_admission_rejections_total",
    "mlxpp_pp_repartition_events_total",
    "mlxpp_http_requests_total",
    "mlxpp_prompt_tokens_total",
    "mlxpp_generation_tokens_total",
    "mlxpp_transport_handshake_failures_total",
    "mlxpp_transport_rejected_frames_total",
    "mlxpp_transport_preauth_refused_total",
    "mlxpp_rdma_fallbacks_total",
    "mlxpp_config_reload_failures_total",
)

# Every series name the metrics server exposes at /metrics, as written in the exposition format:
# histograms as _bucket/_sum/_count, summaries as _sum/_count, plus the plain gauges and counters.
# The serve cluster metrics test checks these same names against a live scrape of /metrics, so a
# dashboard query that passes here names a series that really exists.
EXPORTED = frozenset(
    _PLAIN
    + tuple(f"{name}{suffix}" for name in _HISTOGRAMS for suffix in ("_bucket", "_sum", "_count"))
    + tuple(f"{name}{suffix}" for name in _SUMMARIES for suffix in ("_sum", "_count"))
)

# The dashboard's five key panels: title keywords (all must appear, case-insensitive) and the
# metric family the panel must query.
SPEC_PANELS = {
    "per-stage busy fraction": (("busy", "fraction"), "mlxpp_pp_stage_busy_fraction"),
    "mean bubble ratio": (("bubble", "ratio"), "mlxpp_pp_mean_bubble_ratio"),
    "activation transfer latency": (
        ("activation", "latency"),
        "mlxpp_pp_activation_latency_seconds_bucket",
    ),
    "admission rejection rate": (("admission", "rejection"), "mlxpp_pp_admission_rejections_total"),
    "repartition events": (("repartition", "events"), "mlxpp_pp_repartition_events_total"),
}


def _exprs(panel: dict) -> list[str]:
    return [target["expr"] for target in panel.get("targets", [])]


def _metrics(panel: dict) -> set[str]:
    return {name for expr in _exprs(panel) for name in METRIC_TOKEN.findall(expr)}


def _panel_titled(keywords: tuple[str, ...]) -> dict:
    matches = [p for p in PANELS if all(k in p["title"].lower() for k in keywords)]
    assert len(matches) == 1, f"expected one panel titled with {keywords}, got {matches}"
    return matches[0]


ALL_METRICS = set().union(*(_metrics(panel) for panel in PANELS))


def test_dashboard_identity_for_import() -> None:
    assert DASHBOARD["uid"] == "mlxpp-pipeline"
    assert DASHBOARD["title"]
    assert isinstance(DASHBOARD["schemaVersion"], int) and DASHBOARD["schemaVersion"] >= 36
    assert isinstance(DASHBOARD["version"], int)
    assert DASHBOARD["time"]["from"] and DASHBOARD["time"]["to"]
    assert DASHBOARD["refresh"]
    assert "mlxpp" in DASHBOARD["tags"]


def test_datasource_is_a_prometheus_variable() -> None:
    variables = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "datasource"]
    assert len(variables) == 1
    assert variables[0]["name"] == "datasource"
    assert variables[0]["query"] == "prometheus"


def test_every_panel_and_target_uses_the_datasource_variable() -> None:
    assert PANELS
    for panel in PANELS:
        assert panel["datasource"] == DATASOURCE_REF, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", DATASOURCE_REF) == DATASOURCE_REF, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_panel_ids_and_target_ref_ids_are_unique() -> None:
    ids = [panel["id"] for panel in PANELS]
    assert len(ids) == len(set(ids))
    for panel in PANELS:
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_panels_fit_the_grid_without_overlapping() -> None:
    for panel in PANELS:
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert grid["x"] >= 0 and grid["y"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
    for a, b in combinations(PANELS, 2):
        ga, gb = a["gridPos"], b["gridPos"]
        disjoint = (
            ga["x"] + ga["w"] <= gb["x"]
            or gb["x"] + gb["w"] <= ga["x"]
            or ga["y"] + ga["h"] <= gb["y"]
            or gb["y"] + gb["h"] <= ga["y"]
        )
        assert disjoint, f"{a['title']!r} overlaps {b['title']!r}"


def test_every_queried_metric_is_exported() -> None:
    assert ALL_METRICS
    assert ALL_METRICS <= EXPORTED, sorted(ALL_METRICS - EXPORTED)


def test_rates_use_the_rate_interval() -> None:
    for panel in PANELS:
        for expr in _exprs(panel):
            for window in re.findall(r"\brate\([^\[]*\[([^\]]*)\]", expr):
                assert window == "$__rate_interval", (panel["title"], expr)


@pytest.mark.parametrize("spec_panel", sorted(SPEC_PANELS))
def test_spec_panel_exists_and_queries_its_family(spec_panel: str) -> None:
    keywords, family = SPEC_PANELS[spec_panel]
    panel = _panel_titled(keywords)
    assert family in _metrics(panel), (panel["title"], _exprs(panel))


def test_busy_fraction_is_a_timeseries_per_stage() -> None:
    panel = _panel_titled(("busy", "fraction"))
    assert panel["type"] == "timeseries"
    assert [t["legendFormat"] for t in panel["targets"]] == ["stage {{stage}}"]


def test_mean_bubble_ratio_is_a_stat_with_green_orange_red_thresholds() -> None:
    panel = _panel_titled(("bubble", "ratio"))
    assert panel["type"] == "stat"
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [(s["color"], s["value"]) for s in steps] == [
        ("green", None),
        ("orange", 0.2),
        ("red", 0.4),
    ]


def test_activation_latency_shows_p95_and_p99_per_stage_pair_in_seconds() -> None:
    panel = _panel_titled(("activation", "latency"))
    assert panel["fieldConfig"]["defaults"]["unit"] == "s"
    bucket_rate = (
        "sum by (le, src_stage, dst_stage) "
        "(rate(mlxpp_pp_activation_latency_seconds_bucket[$__rate_interval]))"
    )
    assert _exprs(panel) == [
        f"histogram_quantile(0.95, {bucket_rate})",
        f"histogram_quantile(0.99, {bucket_rate})",
    ]


def test_admission_rejections_are_a_rate_by_stage_and_reason() -> None:
    panel = _panel_titled(("admission", "rejection"))
    assert _exprs(panel) == [
        "sum by (stage, reason) (rate(mlxpp_pp_admission_rejections_total[$__rate_interval]))"
    ]


def test_repartition_events_are_cumulative_by_trigger_and_outcome() -> None:
    panel = _panel_titled(("repartition", "events"))
    (expr,) = _exprs(panel)
    assert "by (trigger, outcome)" in expr
    assert "rate(" not in expr and "increase(" not in expr


def test_serving_panels_are_present() -> None:
    assert "mlxpp_http_requests_total" in _metrics(_panel_titled(("request", "rate")))
    assert "mlxpp_generation_tokens_total" in _metrics(_panel_titled(("tokens", "second")))
    ttft = _panel_titled(("first", "token"))
    assert all(
        e.startswith("histogram_quantile(") and "mlxpp_time_to_first_token_seconds_bucket" in e
        for e in _exprs(ttft)
    )
    assert [e.split(",")[0] for e in _exprs(ttft)] == [
        "histogram_quantile(0.5",
        "histogram_quantile(0.95",
    ]
    kv = _panel_titled(("kv",))
    assert kv["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert {"mlxpp_kv_used_bytes", "mlxpp_kv_budget_bytes"} <= _metrics(kv)
