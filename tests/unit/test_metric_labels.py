"""Label names of kvfleet's series: each says one thing (``sla_tier`` is the tenant's SLA tier, ``kv_tier``
the memory tier a KV entry lives on; nothing is plain ``tier``), and every label a dashboard panel or an
alert groups by, matches on or prints is one that the series it reads carry."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest
from kvfleet_dashboards.alerts import ALERTS
from kvfleet_dashboards.dashboards import ALL_DASHBOARDS
from kvfleet_dashboards.promql import metric_names
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from kvfleet_operator import metrics as operator_metrics
from kvfleet_runtime.engine.lmcache_sync import KV_TIER_LABEL, LMCacheSyncMetrics
from kvfleet_runtime.engine.metrics import PoolSnapshot, TenantSnapshot, build_metric_families
from kvfleet_runtime.engine.shared_tier import SharedTierMetrics
from kvfleet_runtime.gateway.metrics import SLA_TIER_LABEL, GatewayMetrics, LocalCollector

#: Labels Prometheus adds to every scraped series (ServiceMonitor/PodMonitor targets), and ``le``.
TARGET_LABELS = frozenset({"namespace", "instance", "job", "pod", "service", "container", "endpoint", "le"})
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def _wrapper_labels(metrics: Iterable[object]) -> dict[str, frozenset[str]]:
    """Exposed sample name -> label names of prometheus_client metric objects (and of the gateway's
    request-path families, which a ``LocalCollector`` exposes)."""
    out: dict[str, frozenset[str]] = {}
    for metric in metrics:
        if isinstance(metric, LocalCollector):
            defined = [(f.name, f.kind, frozenset(f.labelnames)) for f in metric.families]
        elif isinstance(metric, MetricWrapperBase):
            # prometheus_client has no public accessor for a metric's name, type and label names.
            defined = [(metric._name, metric._type, frozenset(metric._labelnames))]
        else:
            continue
        for name, kind, labels in defined:
            for suffix in _SUFFIXES.get(kind, ("",)):
                out[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def _registry_objects(registry: CollectorRegistry) -> list[object]:
    return list(registry._collector_to_names)  # the collectors registered, in no public list


def defined_labels() -> dict[str, frozenset[str]]:
    """Every kvfleet series (exposed name) -> its label names, from the code that defines it."""
    out = _wrapper_labels(_registry_objects(GatewayMetrics().registry))
    out |= _wrapper_labels(_registry_objects(LMCacheSyncMetrics().registry))
    out |= _wrapper_labels(_registry_objects(operator_metrics.REGISTRY))
    out |= _wrapper_labels(_registry_objects(SharedTierMetrics(CollectorRegistry()).registry))
    snapshot = PoolSnapshot(
        total_blocks=1,
        used_blocks=0,
        cached_blocks=0,
        tenants={"t": TenantSnapshot(1, 0, 1, 1, 1.0)},
        queries={"t": 1},
        queried_tokens={"t": 1},
        hit_tokens={"t": 1},
        hit_blocks={"t": 1},
        evictions={("t", "lru"): 1},
        reloads={"ok": 1},
    )
    for family in build_metric_families(snapshot):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, frozenset()) | frozenset(sample.labels)
    return out


DEFINED = defined_labels()


def test_no_series_has_a_plain_tier_label() -> None:
    assert not [name for name, labels in DEFINED.items() if "tier" in labels]


def test_request_series_carry_the_sla_tier_and_lmcache_series_the_kv_tier() -> None:
    assert SLA_TIER_LABEL == "sla_tier" and KV_TIER_LABEL == "kv_tier"
    for name in (
        "kvfleet_gateway_requests_total",
        "kvfleet_gateway_time_to_first_token_seconds_bucket",
        "kvfleet_gateway_throttled_total",
        "kvfleet_gateway_in_flight_requests",
        "kvfleet_operator_tenants",
    ):
        assert "sla_tier" in DEFINED[name], name
    for name in ("kvfleet_lmcache_tenant_bytes", "kvfleet_lmcache_quota_bytes"):
        assert "kv_tier" in DEFINED[name], name


def _referenced_labels(expr: str, *texts: str) -> set[str]:
    """Labels a PromQL expression groups by or matches on, and that legends/annotations print."""
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)", expr):
        labels |= {part.strip() for part in group.split(",") if part.strip()}
    for matchers in re.findall(r"\{([^{}]*)\}", re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    for text in texts:
        labels |= set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", text))
        labels |= set(re.findall(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)", text))
    return labels


def _queries() -> list[tuple[str, str, tuple[str, ...]]]:
    """(where, expr, texts that print labels) for every panel query and alert that reads only kvfleet's
    series (vLLM defines the labels of its own; the e2e dashboard test runs those against real vLLM)."""
    out = [
        (f"{spec.uid} / {panel.title}", query.expr, (query.legend,))
        for spec in ALL_DASHBOARDS
        for _, panels in spec.rows
        for panel in panels
        for query in panel.queries
    ]
    out += [(alert.name, alert.expr, (alert.summary, alert.description)) for alert in ALERTS]
    return [q for q in out if all(n.startswith("kvfleet_") for n in metric_names(q[1]))]


QUERIES = _queries()


def test_most_queries_are_checked() -> None:
    assert len(QUERIES) >= 30


@pytest.mark.parametrize(("where", "expr", "texts"), QUERIES, ids=[q[0] for q in QUERIES])
def test_every_label_a_query_uses_is_on_the_series_it_reads(where: str, expr: str, texts: tuple[str]) -> None:
    names = metric_names(expr)
    available = set(TARGET_LABELS)
    for name in names:
        available |= DEFINED[name]
    missing = _referenced_labels(expr, *texts) - available
    assert not missing, f"{where}: {sorted(missing)} not on {sorted(names)}"


def test_the_label_check_catches_a_stale_label() -> None:
    expr = "sum by (tenant, tier) (kvfleet_lmcache_tenant_bytes)"
    available = DEFINED["kvfleet_lmcache_tenant_bytes"] | TARGET_LABELS
    assert _referenced_labels(expr, "{{tier}}") - available == {"tier"}
