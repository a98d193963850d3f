"""The operator's Prometheus metrics: defined once, imported by handlers, dashboards and tests."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = "kvfleet_operator_reconciles_total"
RECONCILE_DURATION = "kvfleet_operator_reconcile_duration_seconds"
API_CALLS = "kvfleet_operator_api_calls_total"
TENANTS = "kvfleet_operator_tenants"
POOL_CAPACITY_BLOCKS = "kvfleet_operator_pool_capacity_blocks"
GUARANTEED_BLOCKS = "kvfleet_operator_guaranteed_blocks"

reconciles = Counter(
    RECONCILES.removesuffix("_total"),
    "Reconciles by kind and outcome (ok, retry, invalid, error).",
    ["kind", "outcome"],
    registry=REGISTRY,
)
reconcile_duration = Histogram(
    RECONCILE_DURATION.removesuffix("_seconds") + "_seconds",
    "Wall time of one reconcile.",
    ["kind"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
api_calls = Counter(
    API_CALLS.removesuffix("_total"),
    "Kubernetes API calls made by reconciles, by verb.",
    ["verb"],
    registry=REGISTRY,
)
tenants = Gauge(
    TENANTS,
    "Admitted tenants by ModelDeployment, SLA tier and isolation level.",
    ["namespace", "model_deployment", "sla_tier", "isolation"],
    registry=REGISTRY,
)
pool_capacity_blocks = Gauge(
    POOL_CAPACITY_BLOCKS,
    "HBM KV blocks per replica of a ModelDeployment's shared pool, from the planner.",
    ["namespace", "model_deployment"],
    registry=REGISTRY,
)
guaranteed_blocks = Gauge(
    GUARANTEED_BLOCKS,
    "Sum of tenants' guaranteed HBM KV blocks on a ModelDeployment's shared pool.",
    ["namespace", "model_deployment"],
    registry=REGISTRY,
)

ALL_METRIC_NAMES: frozenset[str] = frozenset(
    {RECONCILES, RECONCILE_DURATION, API_CALLS, TENANTS, POOL_CAPACITY_BLOCKS, GUARANTEED_BLOCKS}
)
