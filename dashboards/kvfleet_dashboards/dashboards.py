"""The four kvfleet dashboards (Fleet, Tenant, KV tiers, Operator), built with grafana-foundation-sdk.

Every panel query uses ``$__rate_interval`` for rates, the ``$datasource`` variable for its data source,
and the ``$model`` / ``$tenant`` variables where the metric carries those labels (the gateway labels by
``model`` and ``tenant``; vLLM by ``model_name``). Metric names are imported from the code that defines
them. uids are fixed strings, so links and provisioning survive regeneration.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.builders.common import GraphThresholdsStyleConfig, VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as gc
from grafana_foundation_sdk.models import dashboard as gm

from kvfleet_dashboards.catalog import metric
from kvfleet_operator import metrics as om
from kvfleet_runtime.engine import metrics as em
from kvfleet_runtime.gateway import metrics as gw

#: The TTFT objective every TTFT panel draws as a line and the TTFT alert fires on (seconds).
TTFT_SLO_SECONDS = 0.5
#: KV cache usage above which a replica should be scaled out or its KV compressed (fraction).
KV_USAGE_LIMIT = 0.9

# vLLM's own metrics (checked against the installed vLLM source by the tests).
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits_total"
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
VLLM_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # tokens served by the KV connector (LMCache)
VLLM_EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
VLLM_PREEMPTIONS = "vllm:num_preemptions_total"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens_total"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"

# The LMCache sync's metrics (defined as literals in kvfleet_runtime.engine.lmcache_sync; checked here).
LMCACHE_TENANT_BYTES = metric("kvfleet_lmcache_tenant_bytes")
LMCACHE_QUOTA_BYTES = metric("kvfleet_lmcache_quota_bytes")
LMCACHE_TTL_EXPIRATIONS = metric("kvfleet_lmcache_ttl_expirations_total")
LMCACHE_SALT_REMOVALS = metric("kvfleet_lmcache_salt_removals_total")
LMCACHE_SYNC_ERRORS = metric("kvfleet_lmcache_sync_errors_total")
LMCACHE_SYNC_LAST_SUCCESS = metric("kvfleet_lmcache_sync_last_success_timestamp_seconds")

# The shared KV tier's metrics (kvfleet_runtime.engine.shared_tier; labelled by salt_hash, never a salt).
SHARED_TIER_BYTES = metric("kvfleet_shared_tier_bytes")
SHARED_TIER_QUOTA_BYTES = metric("kvfleet_shared_tier_quota_bytes")
SHARED_TIER_EVICTIONS = metric("kvfleet_shared_tier_evictions_total")
SHARED_TIER_REQUESTS = metric("kvfleet_shared_tier_requests_total")

DATASOURCE = gm.DataSourceRef(type_val="prometheus", uid="${datasource}")
MODEL = 'model=~"$model"'
VLLM_MODEL = 'model_name=~"$model"'
TENANT = 'model=~"$model", tenant=~"$tenant"'
LMCACHE_TENANT = 'tenant=~"$tenant"'


@dataclass(frozen=True)
class Query:
    """One PromQL query of a panel and its legend.

    ``event_expr`` is set on the queries of rare-event counters that the panel pads with a zero baseline
    (:func:`event_query`): it is the query without the baseline, whose series only the event itself
    creates. ``proof_expr`` is what proves the panel against a real Prometheus
    (tests/e2e/test_dashboards_e2e.py): a baseline is for display and never counts as data.
    """

    expr: str
    legend: str = ""
    event_expr: str | None = None

    @property
    def proof_expr(self) -> str:
        """The query without any zero baseline (``expr`` when it has none)."""
        return self.expr if self.event_expr is None else self.event_expr


@dataclass(frozen=True)
class PanelSpec:
    """A time-series (or stat) panel: what it shows, and how."""

    title: str
    description: str
    queries: Sequence[Query]
    unit: str = "short"
    threshold: float | None = None  # drawn as a red line (SLOs and limits)
    max_value: float | None = None
    span: int = 12
    stat: bool = False


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    rows: Sequence[tuple[str, Sequence[PanelSpec]]]
    variables: Sequence[str] = ("model",)  # template variables besides the data source
    tags: Sequence[str] = field(default_factory=lambda: ("kvfleet",))


def rate(name: str, selector: str, by: str = "") -> str:
    """``sum [by (...)] (rate(name{selector}[$__rate_interval]))``."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({name}{{{selector}}}[$__rate_interval]))"


def quantile(q: float, bucket: str, selector: str, by: str = "") -> str:
    """The ``q`` quantile of a histogram over ``$__rate_interval``, grouped by ``by``."""
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({bucket}{{{selector}}}[$__rate_interval])))"


def ratio(num: str, den: str, selector: str, by: str = "") -> str:
    """Rate of ``num`` over rate of ``den`` (a hit rate), both summed by ``by``."""
    return f"{rate(num, selector, by)} / {rate(den, selector, by)}"


def or_zero(expr: str, baseline: str, on: str) -> str:
    """``expr``, plus a 0 series for every series of ``baseline`` whose ``on`` labels ``expr`` lacks.

    For counters of rare events (errors, throttles, evictions) whose labelled series only appear with the
    first event: the panel shows a flat 0 per tenant/pool instead of "No data", and nothing extra for a
    tenant/pool that has events.
    """
    return f"({expr}) or on ({on}) ({baseline} * 0)"


def event_query(expr: str, baseline: str, on: str, legend: str) -> Query:
    """A panel query of a rare-event counter: shown with :func:`or_zero`'s baseline, proven without it."""
    return Query(or_zero(expr, baseline, on), legend, event_expr=expr)


def usage_total(name: str, selector: str) -> str:
    """What counter ``name`` gained per tenant over the dashboard's time range (``$__range``)."""
    return f"sum by (tenant) (round(increase({name}{{{selector}}}[$__range])))"


def _bucket(name: str) -> str:
    return f"{name}_bucket"


def _count(name: str) -> str:
    return f"{name}_count"


# --- Fleet ------------------------------------------------------------------------------------------------
TTFT = _bucket(gw.TTFT_SECONDS)
FLEET = DashboardSpec(
    uid="kvfleet-fleet",
    title="kvfleet / Fleet",
    description="Every ModelDeployment at a glance: traffic, tokens, TTFT against the SLO, KV cache use.",
    rows=(
        (
            "Traffic",
            (
                PanelSpec(
                    "Requests by outcome",
                    "Requests the gateways finished per second, by outcome (ok, throttled, errors...).",
                    [Query(rate(gw.REQUESTS_TOTAL, MODEL, "outcome"), "{{outcome}}")],
                    unit="reqps",
                ),
                PanelSpec(
                    "Tokens per second",
                    "Generated tokens (engine) and prompt/completion tokens the gateways accounted.",
                    [
                        Query(rate(VLLM_GENERATION_TOKENS, VLLM_MODEL), "generated (engines)"),
                        Query(rate(VLLM_PROMPT_TOKENS, VLLM_MODEL), "prompt (engines)"),
                        Query(rate(gw.COMPLETION_TOKENS_TOTAL, MODEL), "completion (gateways)"),
                    ],
                    unit="short",
                ),
                PanelSpec(
                    "Time to first token p50 / p99",
                    f"Measured at the gateway, against the {TTFT_SLO_SECONDS * 1000:.0f} ms SLO (red line).",
                    [
                        Query(quantile(0.5, TTFT, MODEL), "p50"),
                        Query(quantile(0.99, TTFT, MODEL), "p99"),
                    ],
                    unit="s",
                    threshold=TTFT_SLO_SECONDS,
                ),
                PanelSpec(
                    "Requests running / waiting in the engines",
                    "vLLM's scheduler queues, summed over replicas.",
                    [
                        Query(f"sum (vllm:num_requests_running{{{VLLM_MODEL}}})", "running"),
                        Query(f"sum (vllm:num_requests_waiting{{{VLLM_MODEL}}})", "waiting"),
                    ],
                ),
            ),
        ),
        (
            "KV cache",
            (
                PanelSpec(
                    "KV cache usage per replica",
                    f"Fraction of each replica's GPU KV blocks in use; above {KV_USAGE_LIMIT:.0%} scale out "
                    "or compress (FP8 KV).",
                    [Query(f"max by (instance) ({VLLM_KV_USAGE}{{{VLLM_MODEL}}})", "{{instance}}")],
                    unit="percentunit",
                    threshold=KV_USAGE_LIMIT,
                    max_value=1,
                ),
                PanelSpec(
                    "Prefix cache hit rate (GPU)",
                    "Prompt tokens found in vLLM's prefix cache over prompt tokens looked up.",
                    [Query(ratio(VLLM_PREFIX_HITS, VLLM_PREFIX_QUERIES, VLLM_MODEL), "hit rate")],
                    unit="percentunit",
                    max_value=1,
                ),
                PanelSpec(
                    "LMCache hit rate (CPU / NVMe)",
                    "Prompt tokens served by LMCache (vLLM's KV connector) over tokens looked up there.",
                    [Query(ratio(VLLM_EXTERNAL_HITS, VLLM_EXTERNAL_QUERIES, VLLM_MODEL), "hit rate")],
                    unit="percentunit",
                    max_value=1,
                ),
                PanelSpec(
                    "Preemptions",
                    "Requests vLLM preempted per second (KV cache exhausted), per replica.",
                    [Query(rate(VLLM_PREEMPTIONS, VLLM_MODEL, "instance"), "{{instance}}")],
                    unit="short",
                ),
                PanelSpec(
                    "Gateway upstream errors",
                    "Failures talking to engine replicas, by pool and kind.",
                    [
                        event_query(
                            rate(gw.UPSTREAM_ERRORS_TOTAL, "", "pool, kind"),
                            f"sum by (pool) ({gw.REPLICA_HEALTHY})",
                            on="pool",
                            legend="{{pool}} {{kind}}",
                        )
                    ],
                    unit="short",
                ),
                PanelSpec(
                    "Healthy replicas",
                    "Engine replicas whose last health check from the gateway passed, per pool.",
                    [Query(f"sum by (pool) ({gw.REPLICA_HEALTHY})", "{{pool}}")],
                ),
            ),
        ),
        (
            "Gateway queues, replicas and routing",
            (
                PanelSpec(
                    "Requests held at the gateway",
                    "Requests admitted but waiting for room on the pool's engines, per pool and SLA tier "
                    "(released in fair order), summed over gateway replicas.",
                    [Query(f"sum by (pool, sla_tier) ({gw.ENGINE_QUEUE_DEPTH})", "{{pool}} {{sla_tier}}")],
                ),
                PanelSpec(
                    "Fair-queuing virtual counters",
                    "Each tenant's weighted tokens served divided by its weight (VTC): tenants of one tier "
                    "that are backlogged stay close; the highest of the gateway replicas.",
                    [Query(f"max by (tenant) ({gw.FAIR_VIRTUAL_TOKENS})", "{{tenant}}")],
                ),
                PanelSpec(
                    "Shared store",
                    "Gateway replicas splitting rate limits and engine slots through the shared store (0: "
                    "static 1/replicas shares, no store or unreachable), the replicas the store sees, and "
                    "syncs per second by outcome (ok, error).",
                    [
                        Query(f"sum ({gw.SHARED_STORE_UP})", "replicas using the store"),
                        Query(f"max ({gw.SHARED_STORE_REPLICAS})", "replicas the store sees"),
                        Query(rate(gw.SHARED_STORE_SYNCS_TOTAL, "", "outcome"), "syncs/s {{outcome}}"),
                    ],
                ),
                PanelSpec(
                    "Routing decisions",
                    "Replica choices per second, per pool: precise (the replica holding the longest cached "
                    "prefix of the tenant's blocks, from the engines' KV events) or affinity (the salted "
                    "prefix hash, where the index knows none).",
                    [Query(rate(gw.ROUTE_DECISIONS_TOTAL, "", "pool, how"), "{{pool}} {{how}}")],
                    unit="reqps",
                ),
                PanelSpec(
                    "Routing index",
                    "KV blocks the index knows the pool's replicas hold (highest of the gateway replicas), "
                    "and KV events received per second by kind.",
                    [
                        Query(f"max by (pool) ({gw.KV_INDEX_BLOCKS})", "{{pool}} blocks"),
                        Query(rate(gw.KV_EVENTS_TOTAL, "", "pool, kind"), "{{pool}} {{kind}}/s"),
                    ],
                ),
                PanelSpec(
                    "Routing index: predicted against reported hits",
                    "Prompt tokens the index predicted cached on the replica it chose, and those the "
                    "engines then reported cached for the same requests: apart, the index is stale (it "
                    "corrects itself).",
                    [
                        Query(rate(gw.ROUTE_PREDICTED_CACHED_TOKENS_TOTAL, "", "pool"), "{{pool}} predicted"),
                        Query(rate(gw.ROUTE_REPORTED_CACHED_TOKENS_TOTAL, "", "pool"), "{{pool}} reported"),
                    ],
                    unit="short",
                ),
            ),
        ),
    ),
)

# --- Tenant -----------------------------------------------------------------------------------------------
TENANT_DASHBOARD = DashboardSpec(
    uid="kvfleet-tenant",
    title="kvfleet / Tenant",
    description="Per tenant: prefix hit rate, TTFT against the SLO, throttling, LMCache quota use, expiries.",
    variables=("model", "tenant"),
    rows=(
        (
            "Latency and cache",
            (
                PanelSpec(
                    "Prefix hit rate per tenant",
                    "Prompt tokens served from cache (usage.prompt_tokens_details.cached_tokens) over prompt "
                    "tokens, per tenant.",
                    [
                        Query(
                            ratio(gw.CACHED_PROMPT_TOKENS_TOTAL, gw.PROMPT_TOKENS_TOTAL, TENANT, "tenant"),
                            "{{tenant}} (gateway)",
                        ),
                        Query(
                            ratio(em.PREFIX_HIT_TOKENS, em.PREFIX_QUERIED_TOKENS, LMCACHE_TENANT, "tenant"),
                            "{{tenant}} (engine HBM)",
                        ),
                    ],
                    unit="percentunit",
                    max_value=1,
                ),
                PanelSpec(
                    "TTFT p50 / p99 per tenant",
                    f"Time to first token at the gateway against the {TTFT_SLO_SECONDS * 1000:.0f} ms SLO.",
                    [
                        Query(quantile(0.5, TTFT, TENANT, "tenant"), "{{tenant}} p50"),
                        Query(quantile(0.99, TTFT, TENANT, "tenant"), "{{tenant}} p99"),
                    ],
                    unit="s",
                    threshold=TTFT_SLO_SECONDS,
                ),
                PanelSpec(
                    "Requests per tenant",
                    "Finished requests per second by tenant and outcome.",
                    [Query(rate(gw.REQUESTS_TOTAL, TENANT, "tenant, outcome"), "{{tenant}} {{outcome}}")],
                    unit="reqps",
                ),
                PanelSpec(
                    "Throttled requests",
                    "Requests answered 429 by admission control, by tenant and reason (rate, tokens, "
                    "concurrency, KV budget).",
                    [
                        event_query(
                            rate(gw.THROTTLED_TOTAL, LMCACHE_TENANT, "tenant, reason"),
                            rate(gw.REQUESTS_TOTAL, LMCACHE_TENANT, "tenant"),
                            on="tenant",
                            legend="{{tenant}} {{reason}}",
                        )
                    ],
                    unit="reqps",
                ),
            ),
        ),
        (
            "KV quota",
            (
                PanelSpec(
                    "KV quota utilisation per tier",
                    "What a tenant holds over its quota, per tier: HBM blocks on each engine replica, "
                    "bytes in LMCache's CPU and NVMe tiers. Above 100% the tenant is over quota and is "
                    "evicted first.",
                    [
                        Query(
                            f"max by (tenant) ({em.TENANT_RESIDENT_BLOCKS}{{{LMCACHE_TENANT}}} / "
                            f"({em.TENANT_QUOTA_BLOCKS}{{{LMCACHE_TENANT}}} > 0))",
                            "{{tenant}} hbm",
                        ),
                        Query(
                            f"sum by (tenant, kv_tier) ({LMCACHE_TENANT_BYTES}{{{LMCACHE_TENANT}}}) / "
                            f"sum by (tenant, kv_tier) ({LMCACHE_QUOTA_BYTES}{{{LMCACHE_TENANT}}} > 0)",
                            "{{tenant}} {{kv_tier}}",
                        ),
                    ],
                    unit="percentunit",
                    threshold=1.0,
                ),
                PanelSpec(
                    "KV tokens in flight",
                    "Estimated KV footprint (prompt + max_tokens) of each tenant's admitted requests.",
                    [Query(f"sum by (tenant) ({gw.KV_IN_FLIGHT_TOKENS}{{{LMCACHE_TENANT}}})", "{{tenant}}")],
                ),
                PanelSpec(
                    "Evictions by tier and reason",
                    "HBM blocks evicted by kvfleet's policy per second (reason ttl, over_quota or lru), and "
                    "LMCache TTL expiries per tier (CPU, NVMe).",
                    [
                        event_query(
                            rate(em.EVICTIONS, LMCACHE_TENANT, "tenant, reason"),
                            f"sum by (tenant) ({em.TENANT_RESIDENT_BLOCKS}{{{LMCACHE_TENANT}}})",
                            on="tenant",
                            legend="{{tenant}} hbm {{reason}}",
                        ),
                        event_query(
                            rate(LMCACHE_TTL_EXPIRATIONS, LMCACHE_TENANT, "tenant, kv_tier"),
                            f"sum by (tenant, kv_tier) ({LMCACHE_TENANT_BYTES}{{{LMCACHE_TENANT}}})",
                            on="tenant, kv_tier",
                            legend="{{tenant}} {{kv_tier}} ttl",
                        ),
                    ],
                ),
                PanelSpec(
                    "Admission queue time p99",
                    "Time requests waited in the tenant's admission queue.",
                    [
                        Query(
                            quantile(0.99, _bucket(gw.QUEUE_TIME_SECONDS), LMCACHE_TENANT, "tenant"),
                            "{{tenant}}",
                        )
                    ],
                    unit="s",
                ),
            ),
        ),
        (
            "Usage (bill)",
            (
                PanelSpec(
                    "Usage (bill)",
                    "What each tenant used over the dashboard's time range: API answers (any status), "
                    "prompt tokens, prompt tokens served from the prefix cache, and completion tokens, as "
                    "the engine reported them in usage. Prometheus's increase() extrapolates; the exact "
                    "per-day bill is `kvfleet usage` (docs/operations.md, Metering and usage).",
                    [
                        Query(usage_total(gw.RESPONSES_TOTAL, LMCACHE_TENANT), "{{tenant}} requests"),
                        Query(usage_total(gw.PROMPT_TOKENS_TOTAL, TENANT), "{{tenant}} prompt"),
                        Query(usage_total(gw.CACHED_PROMPT_TOKENS_TOTAL, TENANT), "{{tenant}} cached"),
                        Query(usage_total(gw.COMPLETION_TOKENS_TOTAL, TENANT), "{{tenant}} completion"),
                    ],
                    stat=True,
                ),
            ),
        ),
    ),
)

# --- KV tiers ---------------------------------------------------------------------------------------------
KV_TIERS = DashboardSpec(
    uid="kvfleet-kv-tiers",
    title="kvfleet / KV tiers",
    description="The KV cache on every tier: GPU memory per replica, LMCache CPU and NVMe per tenant, the "
    "pool's shared tier per salt.",
    variables=("model", "tenant"),
    rows=(
        (
            "Occupancy",
            (
                PanelSpec(
                    "HBM (GPU) KV usage per replica",
                    "Fraction of GPU KV blocks in use on each engine replica.",
                    [Query(f"max by (instance) ({VLLM_KV_USAGE}{{{VLLM_MODEL}}})", "{{instance}}")],
                    unit="percentunit",
                    threshold=KV_USAGE_LIMIT,
                    max_value=1,
                ),
                PanelSpec(
                    "HBM occupancy per tenant",
                    "KV blocks holding each tenant's cached prefixes in the engines' GPU memory (all "
                    "replicas), and its guaranteed blocks.",
                    [
                        Query(
                            f"sum by (tenant) ({em.TENANT_RESIDENT_BLOCKS}{{{LMCACHE_TENANT}}})",
                            "{{tenant}} resident",
                        ),
                        Query(
                            f"sum by (tenant) ({em.TENANT_QUOTA_BLOCKS}{{{LMCACHE_TENANT}}})",
                            "{{tenant}} quota",
                        ),
                    ],
                ),
                PanelSpec(
                    "CPU tier occupancy per tenant",
                    "Bytes of each tenant's KV in LMCache's CPU memory (L1).",
                    [
                        Query(
                            f'sum by (tenant) ({LMCACHE_TENANT_BYTES}{{{LMCACHE_TENANT}, kv_tier="cpu"}})',
                            "{{tenant}}",
                        )
                    ],
                    unit="bytes",
                ),
                PanelSpec(
                    "NVMe tier occupancy per tenant",
                    "Bytes of each tenant's KV in LMCache's NVMe tier (L2).",
                    [
                        Query(
                            f'sum by (tenant) ({LMCACHE_TENANT_BYTES}{{{LMCACHE_TENANT}, kv_tier="nvme"}})',
                            "{{tenant}}",
                        )
                    ],
                    unit="bytes",
                ),
                PanelSpec(
                    "LMCache quotas per tenant",
                    "Each tenant's quota per tier, from the tenant table.",
                    [
                        Query(
                            f"sum by (tenant, kv_tier) ({LMCACHE_QUOTA_BYTES}{{{LMCACHE_TENANT}}})",
                            "{{tenant}} {{kv_tier}}",
                        )
                    ],
                    unit="bytes",
                ),
            ),
        ),
        (
            "Movement",
            (
                PanelSpec(
                    "HBM evictions by reason",
                    "Cached GPU blocks evicted per second by kvfleet's policy: idle past the tenant's TTL, "
                    "tenant over quota, or plain LRU.",
                    [
                        event_query(
                            rate(em.EVICTIONS, LMCACHE_TENANT, "tenant, reason"),
                            f"sum by (tenant) ({em.TENANT_RESIDENT_BLOCKS}{{{LMCACHE_TENANT}}})",
                            on="tenant",
                            legend="{{tenant}} {{reason}}",
                        )
                    ],
                ),
                PanelSpec(
                    "Restores from LMCache",
                    "Prompt tokens per second restored from LMCache instead of recomputed, per replica.",
                    [Query(rate(VLLM_EXTERNAL_HITS, VLLM_MODEL, "instance"), "{{instance}}")],
                ),
                PanelSpec(
                    "TTL expiries",
                    "Idle data dropped past its TTL, by tier and tenant.",
                    [
                        event_query(
                            rate(LMCACHE_TTL_EXPIRATIONS, LMCACHE_TENANT, "kv_tier, tenant"),
                            f"sum by (kv_tier, tenant) ({LMCACHE_TENANT_BYTES}{{{LMCACHE_TENANT}}})",
                            on="kv_tier, tenant",
                            legend="{{kv_tier}} {{tenant}}",
                        )
                    ],
                ),
                PanelSpec(
                    "Salts removed",
                    "Tenants' cache salts removed from LMCache endpoints (tenant deleted or moved).",
                    [
                        event_query(
                            rate(LMCACHE_SALT_REMOVALS, "", "endpoint"),
                            f"sum by (endpoint) ({LMCACHE_SYNC_LAST_SUCCESS})",
                            on="endpoint",
                            legend="{{endpoint}}",
                        )
                    ],
                ),
                PanelSpec(
                    "LMCache sync health",
                    "Seconds since the last successful quota/TTL sync of each LMCache endpoint, and sync "
                    "errors per second.",
                    [
                        Query(f"time() - {LMCACHE_SYNC_LAST_SUCCESS}", "{{endpoint}} age"),
                        event_query(
                            rate(LMCACHE_SYNC_ERRORS, "", "endpoint"),
                            f"sum by (endpoint) ({LMCACHE_SYNC_LAST_SUCCESS})",
                            on="endpoint",
                            legend="{{endpoint}} errors/s",
                        ),
                    ],
                    unit="s",
                ),
            ),
        ),
        (
            "Shared KV tier",
            (
                PanelSpec(
                    "Shared tier occupancy per salt",
                    "Bytes each cache salt holds in the pool's shared KV tier (spec.kvCache.shared: one "
                    "server every replica of the pool stores chunks to and reads from), and its quota (its "
                    "tenants' CPU-tier quota). A salt is shown by its salt_hash, never the salt itself.",
                    [
                        Query(f"sum by (salt_hash) ({SHARED_TIER_BYTES})", "{{salt_hash}} resident"),
                        Query(f"sum by (salt_hash) ({SHARED_TIER_QUOTA_BYTES})", "{{salt_hash}} quota"),
                    ],
                    unit="bytes",
                ),
                PanelSpec(
                    "Shared tier requests by result",
                    "Requests per second the replicas' LMCache sent the shared tier: get (a hit is a chunk "
                    "another replica computed), exists, and set (stored, or refused for a salt the tenant "
                    "table does not know).",
                    [Query(rate(SHARED_TIER_REQUESTS, "", "op, result"), "{{op}} {{result}}")],
                    unit="reqps",
                ),
                PanelSpec(
                    "Shared tier evictions by reason",
                    "Chunks per second the shared tier evicted by kvfleet's policy, by salt and reason "
                    "(idle past the TTL, salt over its burst cap, or the tier full).",
                    [
                        event_query(
                            rate(SHARED_TIER_EVICTIONS, "", "salt_hash, reason"),
                            f"sum by (salt_hash) ({SHARED_TIER_BYTES})",
                            on="salt_hash",
                            legend="{{salt_hash}} {{reason}}",
                        )
                    ],
                ),
            ),
        ),
    ),
)

# --- Operator ---------------------------------------------------------------------------------------------
OPERATOR = DashboardSpec(
    uid="kvfleet-operator",
    title="kvfleet / Operator",
    description="The operator: reconciles, errors, durations, API calls, tenants by SLA tier and isolation.",
    variables=(),
    rows=(
        (
            "Reconciles",
            (
                PanelSpec(
                    "Reconciles by outcome",
                    "Reconciles per second by kind and outcome (ok, retry, invalid, error).",
                    [Query(rate(om.RECONCILES, "", "kind, outcome"), "{{kind}} {{outcome}}")],
                    unit="ops",
                ),
                PanelSpec(
                    "Reconcile errors",
                    "Reconciles that ended in an error, per second.",
                    [
                        event_query(
                            rate(om.RECONCILES, 'outcome="error"', "kind"),
                            rate(om.RECONCILES, "", "kind"),
                            on="kind",
                            legend="{{kind}}",
                        )
                    ],
                    unit="ops",
                ),
                PanelSpec(
                    "Reconcile duration p50 / p99",
                    "Wall time of one reconcile.",
                    [
                        Query(quantile(0.5, _bucket(om.RECONCILE_DURATION), "", "kind"), "{{kind}} p50"),
                        Query(quantile(0.99, _bucket(om.RECONCILE_DURATION), "", "kind"), "{{kind}} p99"),
                    ],
                    unit="s",
                ),
                PanelSpec(
                    "Kubernetes API calls",
                    "API calls the reconciles made, by verb.",
                    [Query(rate(om.API_CALLS, "", "verb"), "{{verb}}")],
                    unit="ops",
                ),
            ),
        ),
        (
            "Fleet",
            (
                PanelSpec(
                    "Tenants by SLA tier and isolation",
                    "Admitted tenants, by SLA tier and isolation level.",
                    [Query(f"sum by (sla_tier, isolation) ({om.TENANTS})", "{{sla_tier}} / {{isolation}}")],
                ),
                PanelSpec(
                    "Shared-pool capacity vs guarantees",
                    "HBM KV blocks per replica of each shared pool, and the blocks tenants are guaranteed.",
                    [
                        Query(
                            f"sum by (model_deployment) ({om.POOL_CAPACITY_BLOCKS})",
                            "{{model_deployment}} capacity",
                        ),
                        Query(
                            f"sum by (model_deployment) ({om.GUARANTEED_BLOCKS})",
                            "{{model_deployment}} guaranteed",
                        ),
                    ],
                ),
            ),
        ),
    ),
)

ALL_DASHBOARDS: tuple[DashboardSpec, ...] = (FLEET, TENANT_DASHBOARD, KV_TIERS, OPERATOR)

#: Template variables: name -> (label, query). The query is Grafana's Prometheus ``label_values``.
VARIABLES: dict[str, tuple[str, str]] = {
    "model": ("Model", f"label_values({gw.REQUESTS_TOTAL}, model)"),
    "tenant": ("Tenant", f'label_values({gw.REQUESTS_TOTAL}{{model=~"$model"}}, tenant)'),
}


def _target(query: Query, ref: str) -> gp.Dataquery:
    return gp.Dataquery().expr(query.expr).legend_format(query.legend or "__auto").ref_id(ref).range()


def _thresholds(value: float | None) -> gd.ThresholdsConfig:
    steps = [gm.Threshold(value=None, color="green")]
    if value is not None:
        steps.append(gm.Threshold(value=value, color="red"))
    return gd.ThresholdsConfig().mode(gm.ThresholdsMode.ABSOLUTE).steps(steps)


def build_panel(spec: PanelSpec) -> gts.Panel | gstat.Panel:
    """One panel builder from its spec (time series, threshold drawn as a line when set)."""
    targets = [_target(q, chr(ord("A") + i)) for i, q in enumerate(spec.queries)]
    if spec.stat:
        stat = gstat.Panel().title(spec.title).description(spec.description).datasource(DATASOURCE)
        return stat.targets(list(targets)).unit(spec.unit).span(spec.span).height(6)
    panel = (
        gts.Panel()
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .targets(list(targets))
        .unit(spec.unit)
        .span(spec.span)
        .height(8)
        .min(0)
        .fill_opacity(10)
        .line_width(1)
        .legend(
            VizLegendOptions()
            .show_legend(True)
            .display_mode(gc.LegendDisplayMode.LIST)
            .placement(gc.LegendPlacement.BOTTOM)
        )
        .thresholds(_thresholds(spec.threshold))
    )
    if spec.max_value is not None:
        panel = panel.max(spec.max_value)
    if spec.threshold is not None:
        panel = panel.thresholds_style(GraphThresholdsStyleConfig().mode(gc.GraphTresholdsStyleMode.LINE))
    return panel


def _variables(spec: DashboardSpec) -> list[gd.DatasourceVariable | gd.QueryVariable]:
    out: list[gd.DatasourceVariable | gd.QueryVariable] = [
        gd.DatasourceVariable("datasource").label("Data source").type("prometheus")
    ]
    for name in spec.variables:
        label, query = VARIABLES[name]
        out.append(
            gd.QueryVariable(name)
            .label(label)
            .query(query)
            .datasource(DATASOURCE)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .refresh(gm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(gm.VariableSort.ALPHABETICAL_ASC)
        )
    return out


def build_dashboard(spec: DashboardSpec) -> gd.Dashboard:
    """The dashboard builder for ``spec``."""
    board = (
        gd.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(list(spec.tags))
        .editable()
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
    )
    for variable in _variables(spec):
        board = board.with_variable(variable)
    for title, panels in spec.rows:
        board = board.with_row(gd.Row(title))
        for panel in panels:
            board = board.with_panel(build_panel(panel))
    return board


def render_dashboard(spec: DashboardSpec) -> str:
    """The dashboard as Grafana JSON (stable: sorted keys, two-space indent, trailing newline)."""
    encoded = JSONEncoder(sort_keys=True, indent=2).encode(build_dashboard(spec).build())
    return json.dumps(json.loads(encoded), sort_keys=True, indent=2) + "\n"


def dashboard_queries(spec: DashboardSpec) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel query of ``spec``."""
    return [(panel.title, q.expr) for _, panels in spec.rows for panel in panels for q in panel.queries]


def variable_queries(spec: DashboardSpec) -> list[str]:
    """The metric selectors inside the ``label_values(...)`` queries of ``spec``'s variables."""
    return [VARIABLES[name][1].removeprefix("label_values(").rsplit(",", 1)[0] for name in spec.variables]


def loads(text: str) -> dict[str, Any]:
    """A rendered dashboard parsed back (for tests and the chart)."""
    parsed: dict[str, Any] = json.loads(text)
    return parsed
