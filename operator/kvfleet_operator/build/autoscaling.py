"""The shared pool's KEDA ScaledObject (``spec.pool.autoscaling``). Pure.

KEDA turns the ScaledObject into an HPA on the ModelDeployment's scale subresource (``spec.pool.replicas``),
fed by Prometheus queries over the series kvfleet already exports; the HPA follows the trigger that asks
for most replicas:

* the gateway's engine queue per SLA tier (``kvfleet_gateway_engine_queue_depth``), an ``AverageValue``
  target: replicas = queued requests / target per replica. Premium and standard pressure scale up to
  ``maxReplicas``; best-effort (basic) load alone only to ``bestEffortMaxReplicas``: its query is clamped at
  that many replicas' worth of queue, so it can never ask for more (and is left out when that cap is
  ``minReplicas``, where it could never ask for anything);
* the engines' KV use (blocks held by running requests over usable blocks), a ``Value`` target: replicas
  grow in proportion to how far above the target the pool runs;
* optionally one tier's p99 time to first token at the gateway, a ``Value`` target as well.

Every query answers 0 rather than nothing when its series are absent (a pool without traffic yet), so a
trigger never errors on a quiet pool. The series are selected by namespace and pod name, the labels every
Kubernetes scrape (Prometheus Operator's ServiceMonitor and PodMonitor, :mod:`.monitoring`) attaches.

Only the shared pool scales: dedicated pools' replicas come from their tenants' GPU groups.

**The guarantee floor** (:func:`compute_guarantee_floor`). KV quotas are admitted per replica (every engine
governs its own block pool, ``build/tenant_table.py``), so a replica more or less never breaks a KV
guarantee. What does depend on the replica count is the concurrency the guaranteed tiers (premium and
standard) are promised: an admitted tenant's ``rateLimits.maxConcurrent`` requests must find a seat on some
engine at once. The floor is the replicas those seats need, each replica seating what the gateways give it
at once (``spec.gateway.engineInFlightPerReplica``; else ``spec.engine.maxNumSeqs``; else
:data:`DEFAULT_SEATS_PER_REPLICA`). With autoscaling on it is the ScaledObject's ``minReplicaCount`` (within
minReplicas..maxReplicas), so the HPA never scales in below it, and the engine StatefulSet runs at least
that many whatever ``spec.pool.replicas`` says; ``status.guaranteed`` shows it (``kubectl get md``: FLOOR).
Best-effort (basic) tenants and tenants without ``maxConcurrent`` are promised no seats and add nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_operator.api.modeldeployment import KIND_MODEL_DEPLOYMENT, ModelDeployment, PoolAutoscaling
from kvfleet_operator.api.tenant import Tenant
from kvfleet_operator.build.common import (
    SHARED_POOL,
    Obj,
    Owner,
    engine_name,
    epp_name,
    gateway_name,
    metadata,
    object_labels,
)
from kvfleet_operator.build.tenant_table import TenantDecision

KEDA_API_VERSION = "keda.sh/v1alpha1"
SCALED_OBJECT = "ScaledObject"
#: The series the triggers read. The runtime defines them (kvfleet_runtime.gateway.metrics and
#: kvfleet_runtime.engine.metrics, which the operator may not import: they hold metrics registries);
#: tests/unit/test_autoscaling_build.py fails when these drift from those.
GATEWAY_QUEUE_DEPTH = "kvfleet_gateway_engine_queue_depth"
GATEWAY_TTFT_SECONDS = "kvfleet_gateway_time_to_first_token_seconds"
ENGINE_POOL_BLOCKS = "kvfleet_engine_kv_pool_blocks"
ENGINE_POOL_USED_BLOCKS = "kvfleet_engine_kv_pool_used_blocks"
SLA_TIER_LABEL = "sla_tier"
#: The gateway's label for the pool its queue waits on.
POOL_LABEL = "pool"
#: Tiers whose queue scales up to maxReplicas; basic (best effort) is capped.
GUARANTEED_TIERS = ("premium", "standard")
BEST_EFFORT_TIER = "basic"
#: The window of the time-to-first-token quantile.
TTFT_WINDOW = "2m"
#: Seats per replica when neither spec.gateway.engineInFlightPerReplica nor spec.engine.maxNumSeqs says:
#: vLLM's default max_num_seqs for its OpenAI server on GPUs under 70 GiB (it takes 1,024 on larger ones;
#: set maxNumSeqs to count those).
DEFAULT_SEATS_PER_REPLICA = 256


@dataclass(frozen=True)
class GuaranteeFloor:
    """The shared pool's floor: ``seats`` promised to admitted guaranteed-tier tenants, ``per_replica``
    seats each replica offers, and ``replicas`` they need (``ceil(seats / per_replica)``; 0 without seats)."""

    seats: int
    per_replica: int
    replicas: int

    def minimum(self, autoscaling: PoolAutoscaling) -> int:
        """The ScaledObject's ``minReplicaCount``: the floor, within minReplicas..maxReplicas."""
        return min(max(autoscaling.min_replicas, self.replicas), autoscaling.max_replicas)

    def unmet(self, autoscaling: PoolAutoscaling) -> str | None:
        """Why autoscaling cannot keep the pool at the floor (it still serves), or ``None``: the floor is
        above maxReplicas. Without autoscaling the floor is reported only (``status.guaranteed``)."""
        if not autoscaling.enabled or self.replicas <= autoscaling.max_replicas:
            return None
        return (
            f"the guaranteed tiers' tenants are promised {self.seats} concurrent requests, which need "
            f"{self.replicas} replicas at {self.per_replica} per replica; spec.pool.autoscaling.maxReplicas "
            f"is {autoscaling.max_replicas}. Raise it, or lower those tenants' rateLimits.maxConcurrent."
        )


def seats_per_replica(md: ModelDeployment) -> int:
    """What one engine replica is given at once (see the module docstring)."""
    in_flight = md.spec.gateway.engine_in_flight_per_replica
    if in_flight:
        return in_flight
    return md.spec.engine.max_num_seqs or DEFAULT_SEATS_PER_REPLICA


def compute_guarantee_floor(
    md: ModelDeployment, tenants: Sequence[Tenant], decisions: Sequence[TenantDecision]
) -> GuaranteeFloor:
    """The floor from the tenants admission placed on the shared pool."""
    admitted = {d.name for d in decisions if d.admitted and d.pool == SHARED_POOL}
    seats = sum(
        t.spec.rate_limits.max_concurrent or 0
        for t in tenants
        if str(t.metadata.get("name")) in admitted and t.spec.tier.value in GUARANTEED_TIERS
    )
    per_replica = seats_per_replica(md)
    return GuaranteeFloor(seats=seats, per_replica=per_replica, replicas=-(-seats // per_replica))


def shared_replicas(md: ModelDeployment, floor: GuaranteeFloor) -> int:
    """The replicas the shared pool runs: ``spec.pool.replicas``, never below the floor's minimum while
    autoscaling owns that field (an HPA scale-in, or a hand edit, cannot break a guarantee)."""
    autoscaling = md.spec.pool.autoscaling
    if not autoscaling.enabled:
        return md.spec.pool.replicas
    return max(md.spec.pool.replicas, floor.minimum(autoscaling))


@dataclass(frozen=True)
class Trigger:
    """One signal: its name (what it measures), PromQL, target and HPA metric type."""

    name: str
    query: str
    target: str
    metric_type: str  # AverageValue: total / target replicas; Value: current * value / target

    def to_keda(self, prometheus: str) -> Obj:
        return {
            "type": "prometheus",
            "name": self.name,
            "metricType": self.metric_type,
            "metadata": {"serverAddress": prometheus, "query": self.query, "threshold": self.target},
        }


def scaled_object_name(model_deployment: str) -> str:
    """The shared pool's ScaledObject; KEDA names its HPA ``keda-hpa-<this>``."""
    return engine_name(model_deployment, SHARED_POOL)


def _number(value: float) -> str:
    """A threshold as KEDA parses it (a decimal without exponent; integers without a point)."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6f}".rstrip("0")


def gateway_selector(namespace: str, model_deployment: str) -> str:
    """The gateway's series of this ModelDeployment (its Deployment's pods, or the Endpoint Picker's,
    which serves the gateway's series in the envoy data plane)."""
    pods = f"({gateway_name(model_deployment)}|{epp_name(model_deployment)})-.+"
    return f'namespace="{namespace}",pod=~"{pods}"'


def engine_selector(namespace: str, model_deployment: str) -> str:
    """The shared pool's engine pods (its StatefulSet's ``<name>-<ordinal>``)."""
    return f'namespace="{namespace}",pod=~"{engine_name(model_deployment, SHARED_POOL)}-[0-9]+"'


def build_triggers(namespace: str, model_deployment: str, autoscaling: PoolAutoscaling) -> list[Trigger]:
    """The pool's signals, in a fixed order (KEDA names the HPA's metrics ``s<index>-prometheus``)."""
    signals = autoscaling.signals
    gateway = gateway_selector(namespace, model_deployment)
    triggers: list[Trigger] = []
    targets = signals.queue_per_replica
    for tier in (*GUARANTEED_TIERS, BEST_EFFORT_TIER):
        target: int = getattr(targets, tier)
        if target == 0:
            continue
        queue = (
            f'sum({GATEWAY_QUEUE_DEPTH}{{{gateway},{POOL_LABEL}="{SHARED_POOL}",{SLA_TIER_LABEL}="{tier}"}})'
            " or vector(0)"
        )
        if tier == BEST_EFFORT_TIER:
            cap = autoscaling.best_effort_cap
            if cap <= autoscaling.min_replicas:
                continue  # best-effort load alone may never add a replica: nothing to ask for
            # At most `cap` replicas' worth of queue: ceil(value / target) <= cap.
            queue = f"clamp_max({queue}, {cap * target})"
        triggers.append(Trigger(f"queue-{tier}", queue, str(target), "AverageValue"))
    if signals.kv_usage > 0:
        engines = engine_selector(namespace, model_deployment)
        usage = f"sum({ENGINE_POOL_USED_BLOCKS}{{{engines}}}) / sum({ENGINE_POOL_BLOCKS}{{{engines}}})"
        # An empty pool (0 blocks) divides to NaN: `> -1` drops it, `or vector(0)` answers 0.
        triggers.append(
            Trigger("kv-usage", f"(({usage}) > -1) or vector(0)", _number(signals.kv_usage), "Value")
        )
    if signals.ttft is not None:
        ttft = signals.ttft
        buckets = f'{GATEWAY_TTFT_SECONDS}_bucket{{{gateway},{SLA_TIER_LABEL}="{ttft.tier}"}}'
        p99 = f"histogram_quantile(0.99, sum by (le) (rate({buckets}[{TTFT_WINDOW}])))"
        # No requests in the window: the quantile is NaN; `> -1` drops it and the signal reads 0.
        triggers.append(
            Trigger(f"ttft-{ttft.tier}", f"(({p99}) > -1) or vector(0)", _number(ttft.p99_seconds), "Value")
        )
    return triggers


def build_scaled_object(
    namespace: str,
    model_deployment: str,
    autoscaling: PoolAutoscaling,
    owner: Owner,
    floor: GuaranteeFloor | None = None,
) -> Obj | None:
    """The shared pool's ScaledObject, or ``None`` when autoscaling is off (or has no Prometheus to read);
    its minimum is the guarantee ``floor``'s (minReplicas without one)."""
    if not autoscaling.enabled or autoscaling.prometheus_address is None:
        return None
    name = scaled_object_name(model_deployment)
    triggers = build_triggers(namespace, model_deployment, autoscaling)
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": SCALED_OBJECT,
        "metadata": metadata(name, namespace, object_labels(model_deployment, "engine", SHARED_POOL), owner),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": owner.api_version,
                "kind": KIND_MODEL_DEPLOYMENT,
                "name": model_deployment,
            },
            "minReplicaCount": autoscaling.min_replicas if floor is None else floor.minimum(autoscaling),
            "maxReplicaCount": autoscaling.max_replicas,
            "pollingInterval": autoscaling.polling_interval_seconds,
            "triggers": [t.to_keda(autoscaling.prometheus_address) for t in triggers],
        },
    }
