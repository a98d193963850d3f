"""docs/dashboard-series.md (generated): every panel and alert is listed with the series it reads, and
every series with who exports it; the bill panel reads the metering counters."""

from __future__ import annotations

import pytest
from kvfleet_dashboards import seriesdoc
from kvfleet_dashboards.alerts import ALERTS
from kvfleet_dashboards.dashboards import ALL_DASHBOARDS, TENANT_DASHBOARD

from kvfleet_runtime.gateway import metrics as gw

DOC = seriesdoc.build_series_doc()


def test_every_panel_and_alert_has_a_line() -> None:
    lines = DOC.splitlines()
    for spec in ALL_DASHBOARDS:
        for row, panels in spec.rows:
            for panel in panels:
                assert any(line.startswith(f"| {row} | {panel.title} | `") for line in lines), panel.title
    for alert in ALERTS:
        assert any(line.startswith(f"| {alert.name} | `") for line in lines), alert.name


def test_vllm_series_go_by_their_current_names() -> None:
    for current in (
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert f"| `{current}` | vLLM itself" in DOC
    for old in ("gpu_cache_usage_perc", "gpu_prefix_cache"):
        assert old not in DOC


def test_the_bill_panel_reads_the_metering_counters() -> None:
    bill = next(p for row, panels in TENANT_DASHBOARD.rows for p in panels if p.title == "Usage (bill)")
    read = {name for q in bill.queries for name in seriesdoc.metric_names(q.expr)}
    assert read == {
        gw.RESPONSES_TOTAL,
        gw.PROMPT_TOKENS_TOTAL,
        gw.CACHED_PROMPT_TOKENS_TOTAL,
        gw.COMPLETION_TOKENS_TOTAL,
    }
    assert bill.stat and all("[$__range]" in q.expr for q in bill.queries)


def test_a_series_nobody_exports_is_refused() -> None:
    with pytest.raises(KeyError, match="no known exporter"):
        seriesdoc.source_of("foo_total")
