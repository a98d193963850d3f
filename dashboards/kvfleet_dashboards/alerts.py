"""kvfleet's Prometheus alert rules, as data: one plain rules file for Prometheus and promtool, and the
same groups as the chart's PrometheusRule spec.

Each alert's ``runbook`` annotation points at its section in docs/operations.md (``## Alerts``), and
``promtool test rules`` (dashboards/rules/kvfleet-alerts_test.yaml) has one case that fires it and one
that does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from kvfleet_dashboards.dashboards import (
    KV_USAGE_LIMIT,
    LMCACHE_QUOTA_BYTES,
    LMCACHE_TENANT_BYTES,
    TTFT_SLO_SECONDS,
    VLLM_KV_USAGE,
)
from kvfleet_operator import metrics as om
from kvfleet_runtime.engine import metrics as em
from kvfleet_runtime.gateway import metrics as gw

RUNBOOK_BASE = "https://github.com/kvfleet/kvfleet/blob/main/docs/operations.md"

#: An "eviction storm": a replica evicts cached blocks so fast that its whole GPU KV cache turns over in
#: less than this many seconds (cached prefixes are evicted before they are reused).
EVICTION_STORM_TURNOVER_SECONDS = 60
#: Fraction of a model's requests failing upstream above which the gateway alert fires.
UPSTREAM_ERROR_RATIO = 0.05


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    runbook_anchor: str

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook": f"docs/operations.md#{self.runbook_anchor}",
                "runbook_url": f"{RUNBOOK_BASE}#{self.runbook_anchor}",
            },
        }


ALERTS: tuple[Alert, ...] = (
    Alert(
        name="KvfleetKVCacheNearlyFull",
        expr=f"max by (namespace, instance, model_name) ({VLLM_KV_USAGE}) > {KV_USAGE_LIMIT}",
        for_="10m",
        severity="warning",
        summary="KV cache above {{ $value | humanizePercentage }} on {{ $labels.instance }}",
        description=(
            f"The GPU KV cache of {{{{ $labels.model_name }}}} on {{{{ $labels.instance }}}} has been above "
            f"{KV_USAGE_LIMIT:.0%} for 10 minutes: requests queue and get preempted. Scale the "
            "ModelDeployment out or compress its KV (kvCacheDtype fp8_e5m2)."
        ),
        runbook_anchor="kvfleetkvcachenearlyfull",
    ),
    Alert(
        name="KvfleetTenantTTFTSLOBreached",
        expr=(
            "histogram_quantile(0.99, sum by (tenant, model, le) "
            f"(rate({gw.TTFT_SECONDS}_bucket[5m]))) > {TTFT_SLO_SECONDS}"
        ),
        for_="10m",
        severity="critical",
        summary="Tenant {{ $labels.tenant }} TTFT p99 is {{ $value | humanizeDuration }}",
        description=(
            "The 99th percentile time to first token of tenant {{ $labels.tenant }} on {{ $labels.model }} "
            f"has been above the {TTFT_SLO_SECONDS * 1000:.0f} ms SLO for 10 minutes."
        ),
        runbook_anchor="kvfleettenantttftslobreached",
    ),
    Alert(
        name="KvfleetTenantOverQuota",
        expr=(
            f"max by (namespace, tenant, kv_tier) ({LMCACHE_TENANT_BYTES} / ({LMCACHE_QUOTA_BYTES} > 0)) > 1"
        ),
        for_="15m",
        severity="warning",
        summary="Tenant {{ $labels.tenant }} is over its {{ $labels.kv_tier }} KV quota",
        description=(
            "Tenant {{ $labels.tenant }} has held more than its {{ $labels.kv_tier }} quota in LMCache for "
            "15 minutes ({{ $value | humanizePercentage }} of it). Its data is evicted first; raise the "
            "quota or lower its TTLs."
        ),
        runbook_anchor="kvfleettenantoverquota",
    ),
    Alert(
        name="KvfleetKVEvictionStorm",
        expr=(
            f"sum by (namespace, instance) (rate({em.EVICTIONS}[5m])) > on (namespace, instance) "
            f"(sum by (namespace, instance) ({em.POOL_BLOCKS}) / {EVICTION_STORM_TURNOVER_SECONDS})"
        ),
        for_="10m",
        severity="warning",
        summary="KV eviction storm on {{ $labels.instance }}",
        description=(
            "{{ $labels.instance }} has been evicting {{ $value | humanize }} cached KV blocks per second "
            "for 10 minutes: its whole GPU cache turns over in less than "
            f"{EVICTION_STORM_TURNOVER_SECONDS} s, so cached prefixes are evicted before they are reused. "
            "Check tenants' quotas and burst caps on the Tenant dashboard, scale out, or compress the KV."
        ),
        runbook_anchor="kvfleetkvevictionstorm",
    ),
    Alert(
        name="KvfleetOperatorReconcileErrors",
        expr=f'sum by (namespace, kind) (rate({om.RECONCILES}{{outcome="error"}}[5m])) > 0',
        for_="15m",
        severity="warning",
        summary="The kvfleet operator fails to reconcile {{ $labels.kind }}",
        description=(
            "Reconciles of {{ $labels.kind }} have been ending in errors for 15 minutes. Read the "
            "operator's log and the objects' Ready/Degraded conditions."
        ),
        runbook_anchor="kvfleetoperatorreconcileerrors",
    ),
    Alert(
        name="KvfleetGatewayUpstreamErrors",
        expr=(
            f'sum by (namespace, model) (rate({gw.REQUESTS_TOTAL}{{outcome="upstream_error"}}[5m])) / '
            f"sum by (namespace, model) (rate({gw.REQUESTS_TOTAL}[5m])) > {UPSTREAM_ERROR_RATIO}"
        ),
        for_="5m",
        severity="critical",
        summary="Gateway upstream errors for {{ $labels.model }}",
        description=(
            f"More than {UPSTREAM_ERROR_RATIO:.0%} of requests for {{{{ $labels.model }}}} have failed "
            "upstream (engine 5xx, connection refused or lost, timeouts) for 5 minutes: "
            "{{ $value | humanizePercentage }}. The Fleet dashboard's upstream-errors panel shows the pool "
            f"and kind ({gw.UPSTREAM_ERRORS_TOTAL})."
        ),
        runbook_anchor="kvfleetgatewayupstreamerrors",
    ),
)


def build_rule_groups() -> dict[str, Any]:
    """The rules file content: ``{"groups": [...]}`` (also the PrometheusRule ``spec``)."""
    return {"groups": [{"name": "kvfleet", "rules": [alert.rule() for alert in ALERTS]}]}


def render_rules() -> str:
    """The rules file as YAML (stable order)."""
    header = "# Generated by `make generate` from dashboards/kvfleet_dashboards/alerts.py. Do not edit.\n"
    return header + yaml.safe_dump(build_rule_groups(), sort_keys=False, width=200)
