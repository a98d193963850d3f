"""The dashboards as code: every metric a panel, variable or alert reads is defined in the code (kvfleet's
registries, the installed vLLM's source), and each dashboard has the panels, variables, legends and
thresholds it promises. That every query parses is checked by promtool in
tests/tools/test_dashboards_promtool.py; that the committed JSON is fresh, with every other generated file
(test_generated.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import render_dashboards
from kvfleet_dashboards import catalog
from kvfleet_dashboards.dashboards import (
    ALL_DASHBOARDS,
    FLEET,
    KV_TIERS,
    OPERATOR,
    TENANT_DASHBOARD,
    TTFT_SLO_SECONDS,
    DashboardSpec,
    dashboard_queries,
    render_dashboard,
)
from kvfleet_dashboards.outputs import DASHBOARD_JSON_DIR, build_outputs
from kvfleet_dashboards.promql import metric_names

from components import missing_component
from factories import all_promql

REPO = Path(__file__).resolve().parents[2]


def _known_names() -> frozenset[str]:
    try:
        vllm = catalog.vllm_metric_names()
    except ModuleNotFoundError:
        missing_component("vLLM (for its metric definitions)", "hack/install-engine.sh")
    return catalog.kvfleet_metric_names() | vllm


def test_the_chart_ships_exactly_the_generated_dashboards() -> None:
    generated = {p.name for p in build_outputs() if p.parent == DASHBOARD_JSON_DIR}
    shipped = {p.name for p in (REPO / "charts" / "kvfleet" / "files" / "dashboards").glob("*.json")}
    assert generated == shipped == {"fleet.json", "tenant.json", "kv-tiers.json", "operator.json"}


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("vllm:kv_cache_usage_perc", {"vllm:kv_cache_usage_perc"}),
        (
            'histogram_quantile(0.99, sum by (le, tenant) (rate(x_bucket{t=~"$t"}[$__rate_interval])))',
            {"x_bucket"},
        ),
        ("sum(rate(a_total[5m])) / on (pod) group_left(node) b > bool 0.5", {"a_total", "b"}),
        ('time() - last_success{endpoint="e"} offset 5m', {"last_success"}),
        ('label_replace(up, "x", "$1", "job", "(.*)") unless absent(y)', {"up", "y"}),
        ("max_over_time(c[1h:5m]) and ignoring (instance) d", {"c", "d"}),
    ],
)
def test_metric_names_are_extracted_from_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_vllm_metric_names_come_from_its_source() -> None:
    source = (
        'x = self._counter_cls(\n    name="vllm:foo",\n)\ny = self._histogram_cls(name="vllm:bar_seconds")'
    )
    assert catalog.parse_vllm_metric_names(source) == {
        "vllm:foo_total",
        "vllm:foo_created",
        "vllm:bar_seconds_bucket",
        "vllm:bar_seconds_sum",
        "vllm:bar_seconds_count",
        "vllm:bar_seconds_created",
    }


def test_every_metric_a_panel_variable_or_alert_reads_is_defined_in_code() -> None:
    known = _known_names()
    undefined = {
        (where, name) for where, expr in all_promql() for name in metric_names(expr) if name not in known
    }
    assert not undefined, f"metrics not defined by kvfleet's registries or vLLM: {sorted(undefined)}"


def test_an_undefined_metric_is_caught() -> None:
    """The check above can fail: a typo'd name is not in the catalog."""
    known = _known_names()
    assert "kvfleet_gateway_requests_totl" not in known
    assert "vllm:kv_cache_usage_percent" not in known
    assert metric_names("rate(kvfleet_gateway_requests_totl[5m])") - known == {
        "kvfleet_gateway_requests_totl"
    }


def _panels(spec: DashboardSpec) -> list[dict[str, object]]:
    board = json.loads(render_dashboard(spec))
    return [p for p in board["panels"] if p["type"] != "row"]


def test_dashboards_have_stable_unique_uids_and_a_datasource_variable() -> None:
    uids = [spec.uid for spec in ALL_DASHBOARDS]
    assert uids == ["kvfleet-fleet", "kvfleet-tenant", "kvfleet-kv-tiers", "kvfleet-operator"]
    for spec in ALL_DASHBOARDS:
        board = json.loads(
            (REPO / "dashboards" / "json" / f"{spec.uid.removeprefix('kvfleet-')}.json").read_text()
        )
        assert board["uid"] == spec.uid
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for panel in _panels(spec):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_tenant_and_model_variables() -> None:
    for spec in (FLEET, TENANT_DASHBOARD, KV_TIERS):
        names = {v["name"] for v in json.loads(render_dashboard(spec))["templating"]["list"]}
        assert "model" in names
    for spec in (TENANT_DASHBOARD, KV_TIERS):
        names = {v["name"] for v in json.loads(render_dashboard(spec))["templating"]["list"]}
        assert "tenant" in names


def test_rates_use_rate_interval() -> None:
    for spec in ALL_DASHBOARDS:
        for title, expr in dashboard_queries(spec):
            if "rate(" in expr:
                assert "[$__rate_interval]" in expr, (spec.uid, title)
                assert "[5m]" not in expr and "[1m]" not in expr, (spec.uid, title)


def test_tenant_panels_filter_by_the_tenant_variable() -> None:
    for title, expr in dashboard_queries(TENANT_DASHBOARD):
        assert 'tenant=~"$tenant"' in expr, title


def test_ttft_panels_draw_the_slo_as_a_line() -> None:
    ttft = [
        p
        for spec in ALL_DASHBOARDS
        for p in _panels(spec)
        if "TTFT" in str(p["title"]) or "first token" in str(p["title"])
    ]
    assert len(ttft) >= 2
    for panel in ttft:
        defaults = panel["fieldConfig"]["defaults"]  # type: ignore[index]
        assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"
        assert TTFT_SLO_SECONDS in [s["value"] for s in defaults["thresholds"]["steps"]]
        assert defaults["unit"] == "s"


@pytest.mark.parametrize(
    ("spec", "wanted"),
    [
        (
            FLEET,
            [
                "Requests",
                "Tokens per second",
                "Time to first token",
                "KV cache usage per replica",
                "Prefix cache hit rate",
                "LMCache hit rate",
                "Preemptions",
            ],
        ),
        (
            TENANT_DASHBOARD,
            [
                "Prefix hit rate per tenant",
                "TTFT p50 / p99 per tenant",
                "Throttled requests",
                "quota utilisation per tier",
                "Evictions by tier and reason",
            ],
        ),
        (
            KV_TIERS,
            [
                "HBM occupancy per tenant",
                "HBM evictions by reason",
                "CPU tier occupancy per tenant",
                "NVMe tier occupancy per tenant",
                "TTL expiries",
                "Restores",
            ],
        ),
        (
            OPERATOR,
            ["Reconciles", "Reconcile errors", "Reconcile duration", "Tenants by SLA tier and isolation"],
        ),
    ],
    ids=["fleet", "tenant", "kv-tiers", "operator"],
)
def test_each_dashboard_has_the_panels_the_issue_lists(spec: DashboardSpec, wanted: list[str]) -> None:
    titles = [str(p["title"]) for p in _panels(spec)]
    for want in wanted:
        assert any(want.lower() in t.lower() for t in titles), (
            f"{spec.uid}: no panel about {want!r}: {titles}"
        )


@pytest.mark.parametrize(
    ("template", "labels", "legend"),
    [
        ("{{tenant}} {{reason}}", {"tenant": "acme", "reason": "lru"}, "acme lru"),
        ("{{tenant}} p99", {"tenant": "acme"}, "acme p99"),
        ("{{ tenant }} {{reason}}", {"tenant": "acme"}, "acme"),
        ("__auto", {"__name__": "x", "pool": "shared"}, "pool=shared"),
        ("", {}, "value"),
    ],
)
def test_rendered_legends_follow_grafanas_legend_format(
    template: str, labels: dict[str, str], legend: str
) -> None:
    assert render_dashboards.format_legend(template, labels) == legend


def test_a_panel_renders_to_png(tmp_path: Path) -> None:
    """The renderer draws every panel, thresholds included, without a Prometheus (data given)."""
    panels = [
        render_dashboards.PanelData(
            panel.title,
            panel.unit,
            panel.threshold,
            [q.expr for q in panel.queries],
            [render_dashboards.Series("a", [(0.0, 0.1), (60.0, 0.7)])],
            [1] * len(panel.queries),
        )
        for _, row in FLEET.rows
        for panel in row
    ]
    path = render_dashboards.render_dashboard(FLEET, panels, tmp_path / "fleet.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_a_zero_baseline_is_display_only() -> None:
    """A query padded with ``metric * 0`` says so (``event_expr``), and its proof query reads the panel's
    own counter without the padding: what the e2e test counts as data can never be the baseline."""
    padded = 0
    for spec in ALL_DASHBOARDS:
        for _, panels in spec.rows:
            for panel in panels:
                for query in panel.queries:
                    if "* 0)" not in query.expr:
                        assert query.event_expr is None, (spec.uid, panel.title)
                        continue
                    padded += 1
                    proof = query.proof_expr
                    assert proof != query.expr and " or " not in proof and "* 0" not in proof, panel.title
                    assert query.expr.startswith(f"({proof}) or on ("), panel.title
                    assert metric_names(proof) and metric_names(proof) <= metric_names(query.expr), (
                        panel.title
                    )
    assert padded == 10
