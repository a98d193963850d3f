"""Engine-side per-tenant KV metrics: names, the snapshot they are built from, and their collector.

The tenant-aware block pool (``engine.block_pool``) lives in vLLM's engine-core process and keeps plain
counters on its hot path; nothing here runs there. At scrape time :class:`PoolCollector` asks the pool for
a :class:`PoolSnapshot` and turns it into Prometheus families with :func:`build_metric_families` (pure).
The plugin serves them on ``plugin_metrics_port`` (default 8001) at ``/metrics``, with the in-pod series it
re-exports (vLLM's, LMCache's, the quota sync's: ``engine.metrics_server``); ``/debug/kv``, on loopback
only, serves the same snapshot plus vLLM's own block counts as JSON (tests compare the two).

Every name is ``kvfleet_engine_<name>_<unit>``; ``tenant`` is the accounting tenant (a tenant, the shared
group ``shared:<pool_salt_id>``, or ``unattributed``; see ``engine.attribution``). Dashboards, alert
rules and tests import the names from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "EVICTIONS",
    "METRICS_UPSTREAM_UP",
    "POOL_BLOCKS",
    "POOL_CACHED_BLOCKS",
    "POOL_USED_BLOCKS",
    "PREFIX_HIT_BLOCKS",
    "PREFIX_HIT_TOKENS",
    "PREFIX_QUERIED_TOKENS",
    "PREFIX_QUERIES",
    "TENANT_BURST_BLOCKS",
    "TENANT_PINNED_BLOCKS",
    "TENANT_QUOTA_BLOCKS",
    "TENANT_RESIDENT_BLOCKS",
    "TENANT_TABLE_RELOADS",
    "TENANT_TTL_SECONDS",
    "PoolCollector",
    "PoolSnapshot",
    "TenantSnapshot",
    "build_metric_families",
]

# Gauges per tenant (labels: tenant).
TENANT_RESIDENT_BLOCKS = "kvfleet_engine_kv_resident_blocks"
TENANT_PINNED_BLOCKS = "kvfleet_engine_kv_pinned_blocks"
TENANT_QUOTA_BLOCKS = "kvfleet_engine_kv_quota_blocks"
TENANT_BURST_BLOCKS = "kvfleet_engine_kv_burst_blocks"
TENANT_TTL_SECONDS = "kvfleet_engine_kv_ttl_seconds"
# Counters per tenant (labels: tenant). Prometheus names counters ``<name>_total``.
PREFIX_QUERIES = "kvfleet_engine_prefix_cache_queries_total"
PREFIX_QUERIED_TOKENS = "kvfleet_engine_prefix_cache_queried_tokens_total"
PREFIX_HIT_TOKENS = "kvfleet_engine_prefix_cache_hit_tokens_total"
PREFIX_HIT_BLOCKS = "kvfleet_engine_prefix_cache_hit_blocks_total"
# Labels: tenant, reason (ttl | over_quota | lru).
EVICTIONS = "kvfleet_engine_kv_evictions_total"
# Pool gauges (no labels): usable blocks (the null block excluded), blocks held by running requests
# (what vLLM's kv_cache_usage_perc measures), and blocks holding a cached prefix (resident, any tenant).
POOL_BLOCKS = "kvfleet_engine_kv_pool_blocks"
POOL_USED_BLOCKS = "kvfleet_engine_kv_pool_used_blocks"
POOL_CACHED_BLOCKS = "kvfleet_engine_kv_pool_cached_blocks"
# Labels: result (ok | error).
TENANT_TABLE_RELOADS = "kvfleet_engine_tenant_table_reloads_total"
# Labels: upstream (vllm | lmcache | sync): 1 when the last scrape read that in-pod /metrics, else 0.
METRICS_UPSTREAM_UP = "kvfleet_engine_metrics_upstream_up"


@dataclass(frozen=True)
class TenantSnapshot:
    """One accounting tenant's state on the replica's HBM."""

    resident_blocks: int
    pinned_blocks: int
    quota_blocks: int
    burst_blocks: int
    ttl_seconds: float


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything the metrics report, copied out of the block pool at one instant."""

    total_blocks: int
    used_blocks: int
    cached_blocks: int
    tenants: Mapping[str, TenantSnapshot]
    queries: Mapping[str, int] = field(default_factory=dict)
    queried_tokens: Mapping[str, int] = field(default_factory=dict)
    hit_tokens: Mapping[str, int] = field(default_factory=dict)
    hit_blocks: Mapping[str, int] = field(default_factory=dict)
    #: (tenant, reason) -> evictions made by the policy.
    evictions: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: result -> tenant-table reloads.
    reloads: Mapping[str, int] = field(default_factory=dict)


def _tenant_gauge(name: str, doc: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["tenant"])
    for tenant, value in sorted(values.items()):
        family.add_metric([tenant], value)
    return family


def _tenant_counter(name: str, doc: str, values: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=["tenant"])
    for tenant, value in sorted(values.items()):
        family.add_metric([tenant], value)
    return family


def build_metric_families(snap: PoolSnapshot) -> list[Metric]:
    """The Prometheus families for one snapshot (pure)."""
    t = snap.tenants
    families: list[Metric] = [
        _tenant_gauge(
            TENANT_RESIDENT_BLOCKS,
            "KV blocks holding a cached prefix of the tenant on this replica's HBM (pinned or not).",
            {k: v.resident_blocks for k, v in t.items()},
        ),
        _tenant_gauge(
            TENANT_PINNED_BLOCKS,
            "Of the resident blocks, those referenced by running requests (not evictable).",
            {k: v.pinned_blocks for k, v in t.items()},
        ),
        _tenant_gauge(
            TENANT_QUOTA_BLOCKS,
            "The tenant's guaranteed HBM blocks on this replica.",
            {k: v.quota_blocks for k, v in t.items()},
        ),
        _tenant_gauge(
            TENANT_BURST_BLOCKS,
            "The most HBM blocks the tenant may hold while others need room.",
            {k: v.burst_blocks for k, v in t.items()},
        ),
        _tenant_gauge(
            TENANT_TTL_SECONDS,
            "Idle time after which the tenant's cached blocks are the first eviction candidates.",
            {k: v.ttl_seconds for k, v in t.items()},
        ),
        _tenant_counter(PREFIX_QUERIES, "Requests admitted with a prefix-cache lookup.", snap.queries),
        _tenant_counter(
            PREFIX_QUERIED_TOKENS, "Prompt tokens looked up in the prefix cache.", snap.queried_tokens
        ),
        _tenant_counter(PREFIX_HIT_TOKENS, "Prompt tokens served from the prefix cache.", snap.hit_tokens),
        _tenant_counter(PREFIX_HIT_BLOCKS, "Blocks served from the prefix cache.", snap.hit_blocks),
    ]
    evictions = CounterMetricFamily(
        EVICTIONS.removesuffix("_total"),
        "Cached blocks evicted by kvfleet's policy to make room, by owner and reason.",
        labels=["tenant", "reason"],
    )
    for (tenant, reason), value in sorted(snap.evictions.items()):
        evictions.add_metric([tenant, reason], value)
    families.append(evictions)
    for name, doc, value in (
        (POOL_BLOCKS, "Usable KV blocks of this replica (vLLM's null block excluded).", snap.total_blocks),
        (POOL_USED_BLOCKS, "KV blocks referenced by running requests.", snap.used_blocks),
        (POOL_CACHED_BLOCKS, "KV blocks holding a cached prefix (any tenant).", snap.cached_blocks),
    ):
        families.append(GaugeMetricFamily(name, doc, value=value))
    reloads = CounterMetricFamily(
        TENANT_TABLE_RELOADS.removesuffix("_total"),
        "Tenant table reloads after the file changed, by result.",
        labels=["result"],
    )
    for result, value in sorted(snap.reloads.items()):
        reloads.add_metric([result], value)
    families.append(reloads)
    return families


class PoolCollector(Collector):
    """A prometheus_client collector that snapshots a block pool at every scrape."""

    def __init__(self, snapshot: Callable[[], PoolSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from build_metric_families(self._snapshot())
