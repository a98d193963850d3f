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

A dedicated tenant's pool scales on the same signals within its GPU group's nodes (``Tenant``
``spec.dedicated.autoscaling``): see "Dedicated pools" at the end of this module.

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

**Scale-out admits waiting tenants** (:func:`admit_seats`). On an autoscaled pool a seat is promised only
when it exists: a new guaranteed-tier tenant (one without ``status.admittedQuota``) whose KV quota fits is
admitted only if its seats fit those of the shared pool's *ready* replicas (``readyReplicas`` of the engine
StatefulSet, less any leaving in a drain) beside the seats already promised. Otherwise it waits
(``WaitingForCapacity``): its seats join the floor, so the operator runs (and the ScaledObject keeps) the
replicas they need, up to maxReplicas, and the first reconcile after those replicas are ready admits it.
Waiting tenants are admitted in a stated order: premium before standard, then oldest first (creation time,
then name), and strictly: a tenant is not admitted ahead of one before it that still waits. A tenant whose
seats do not fit even at maxReplicas (beside those admitted and those waiting ahead of it) waits for
nothing the autoscaler can do: it is refused (``ConcurrencyExceedsCapacity``) and holds back no one.
Tenants admitted before keep their seats whatever happens to the replicas (admission is sticky, like KV
quotas); a raise of an admitted tenant's ``maxConcurrent`` raises the floor and is not held back. A waiting
tenant keeps the KV room its quota took in admission (``build/tenant_table.py``), so the room is there
when its seats are. Without autoscaling nothing waits for seats: the floor is only reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_operator.api import reasons
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
from kvfleet_operator.build.tenant_table import TenantDecision, admitted_terms, creation_order

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
    """The shared pool's floor: ``seats`` promised to admitted guaranteed-tier tenants, ``waiting`` seats of
    tenants that wait for replicas (:func:`admit_seats`), ``per_replica`` seats each replica offers, and
    ``replicas`` all of them need (``ceil((seats + waiting) / per_replica)``; 0 without seats)."""

    seats: int
    per_replica: int
    replicas: int
    waiting: int = 0

    def minimum(self, autoscaling: PoolAutoscaling) -> int:
        """The ScaledObject's ``minReplicaCount``: the floor, within minReplicas..maxReplicas."""
        return min(max(autoscaling.min_replicas, self.replicas), autoscaling.max_replicas)

    def unmet(self, autoscaling: PoolAutoscaling) -> str | None:
        """Why autoscaling cannot keep the pool at the floor (it still serves), or ``None``: the seats
        promised to admitted tenants need more than maxReplicas (waiting tenants never do: those that could
        not fit are refused). Without autoscaling the floor is reported only (``status.guaranteed``)."""
        promised = -(-self.seats // self.per_replica)
        if not autoscaling.enabled or promised <= autoscaling.max_replicas:
            return None
        return (
            f"the guaranteed tiers' tenants are promised {self.seats} concurrent requests, which need "
            f"{promised} replicas at {self.per_replica} per replica; spec.pool.autoscaling.maxReplicas "
            f"is {autoscaling.max_replicas}. Raise it, or lower those tenants' rateLimits.maxConcurrent."
        )


def seats_per_replica(md: ModelDeployment) -> int:
    """What one engine replica is given at once (see the module docstring)."""
    in_flight = md.spec.gateway.engine_in_flight_per_replica
    if in_flight:
        return in_flight
    return md.spec.engine.max_num_seqs or DEFAULT_SEATS_PER_REPLICA


def tenant_seats(tenant: Tenant) -> int:
    """The concurrent requests ``tenant`` is promised: a guaranteed tier's ``rateLimits.maxConcurrent``."""
    if tenant.spec.tier.value not in GUARANTEED_TIERS:
        return 0
    return tenant.spec.rate_limits.max_concurrent or 0


def _seat_order(tenant: Tenant) -> tuple[int, str, str]:
    """Premium before standard, then oldest first."""
    return (GUARANTEED_TIERS.index(tenant.spec.tier.value), *creation_order(tenant))


def admit_seats(
    md: ModelDeployment, tenants: Sequence[Tenant], decisions: Sequence[TenantDecision], ready_replicas: int
) -> list[TenantDecision]:
    """``decisions`` (KV admission's, ``build/tenant_table.admit_tenants``) with the new guaranteed-tier
    tenants whose seats the shared pool's ``ready_replicas`` cannot seat yet turned into waiting (or, when
    not even maxReplicas could, refused) decisions; see the module docstring. Unchanged without
    autoscaling."""
    autoscaling = md.spec.pool.autoscaling
    if not autoscaling.enabled:
        return list(decisions)
    by_name = {str(t.metadata.get("name")): t for t in tenants}
    per_replica = seats_per_replica(md)
    ready_seats = ready_replicas * per_replica
    most_seats = autoscaling.max_replicas * per_replica
    admitted = [d.name for d in decisions if d.admitted and d.pool == SHARED_POOL and d.name in by_name]
    shared = [by_name[name] for name in admitted]
    promised = sum(tenant_seats(t) for t in shared if admitted_terms(t) is not None)
    claims = sorted((t for t in shared if admitted_terms(t) is None and tenant_seats(t)), key=_seat_order)
    decided = {d.name: d for d in decisions}
    changed: dict[str, TenantDecision] = {}
    ahead = 0  # seats of the tenants that wait ahead in the order
    for tenant in claims:
        name, seats = str(tenant.metadata["name"]), tenant_seats(tenant)
        figures = (
            f"its {seats} concurrent requests ({tenant.spec.tier.value}, rateLimits.maxConcurrent) beside "
            f"the {promised} promised to tenants admitted before"
            + (f" and {ahead} to tenants waiting ahead of it" if ahead else "")
        )
        if promised + ahead + seats > most_seats:
            changed[name] = _not_admitted(
                decided[name],
                reasons.CONCURRENCY_EXCEEDS_CAPACITY,
                f"{figures} need {-(-(promised + ahead + seats) // per_replica)} replicas at {per_replica} "
                f"per replica; spec.pool.autoscaling.maxReplicas is {autoscaling.max_replicas}. Raise it, or "
                "lower spec.rateLimits.maxConcurrent. Nothing was applied for this tenant.",
            )
        elif ahead == 0 and promised + seats <= ready_seats:
            promised += seats
        else:
            ahead += seats
            need = -(-(promised + ahead) // per_replica)
            changed[name] = _not_admitted(
                decided[name],
                reasons.WAITING_FOR_CAPACITY,
                f"{figures} need {need} ready replicas at {per_replica} per replica; ready now: "
                f"{ready_replicas}. The pool scales out to {need}; the tenant is admitted when they are "
                "ready.",
            )
    return [changed.get(d.name, d) for d in decisions]


def _not_admitted(decision: TenantDecision, reason: str, message: str) -> TenantDecision:
    return dataclasses.replace(
        decision, admitted=False, reason=reason, message=message, quota=None, terms=None, refused=None
    )


def compute_guarantee_floor(
    md: ModelDeployment, tenants: Sequence[Tenant], decisions: Sequence[TenantDecision]
) -> GuaranteeFloor:
    """The floor from the tenants admission placed on the shared pool, and those waiting for seats."""
    by_name = {str(t.metadata.get("name")): t for t in tenants}
    shared = [d for d in decisions if d.pool == SHARED_POOL and d.name in by_name]
    seats = sum(tenant_seats(by_name[d.name]) for d in shared if d.admitted)
    waiting = sum(tenant_seats(by_name[d.name]) for d in shared if d.reason == reasons.WAITING_FOR_CAPACITY)
    per_replica = seats_per_replica(md)
    return GuaranteeFloor(
        seats=seats, per_replica=per_replica, replicas=-(-(seats + waiting) // per_replica), waiting=waiting
    )


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


# --- Dedicated pools (a Tenant's spec.dedicated.autoscaling) -------------------------------------------
#
# One ScaledObject per autoscaled dedicated tenant, owned by the Tenant like its StatefulSet, targeting the
# Tenant's scale subresource (spec.dedicated.replicas). The signals and the Prometheus are the
# ModelDeployment's (spec.pool.autoscaling: the platform chose them), over this pool's series only:
#
# * the gateway's queue for the pool (``pool="dedicated-<tenant>"``) in the tenant's own tier, the only
#   tier on it; best-effort's cap (bestEffortMaxReplicas) is the shared pool's and does not apply: the
#   group serves this tenant alone, so its own basic load may use all of it;
# * KV use over the pool's engine pods (``<md>-dedicated-<tenant>-engine-<ordinal>``);
# * the p99 time to first token of the tenant's requests (the gateway's ``tenant`` label), only when the
#   ModelDeployment's objective is for the tenant's tier.
#
# "Within the group's nodes only": the pool's pods can only run there (required node label and toleration,
# build/model_deployment.py), and the replicas never exceed what the group's schedulable nodes hold
# (:class:`GroupCapacity`, counted in reconcile/group_capacity.py): the ScaledObject's maxReplicaCount is
# the lower of maxReplicas and that, and the StatefulSet runs no more than that whatever
# spec.dedicated.replicas says.

#: The gateway's label for the tenant a latency series is of (kvfleet_runtime.gateway.metrics).
TENANT_LABEL = "tenant"


@dataclass(frozen=True)
class GroupCapacity:
    """What a dedicated GPU group's schedulable nodes (Ready, not cordoned, able to run the pool's pods)
    hold of one pool: ``replicas`` in all, on ``nodes`` nodes offering ``gpus`` of the pool's GPU resource
    (``gpu_resource``), each replica asking ``gpus_per_replica`` of it."""

    group: str
    replicas: int
    nodes: int
    gpus: int
    gpu_resource: str
    gpus_per_replica: int

    def describe(self) -> str:
        """The figures, for a condition message."""
        if self.gpus_per_replica:
            per = f"{self.gpus} {self.gpu_resource} at {self.gpus_per_replica} per replica"
        else:
            per = "CPU engines, by their CPU and memory requests"
        nodes = f"{self.nodes} schedulable node(s)"
        return f"GPU group {self.group} holds {self.replicas} replica(s) ({nodes}, {per})"


@dataclass(frozen=True)
class DedicatedScaling:
    """An autoscaled dedicated pool's bounds: the tenant's ``min_wanted``..``max_wanted``
    (spec.dedicated.autoscaling), within what its group holds (``capacity``; ``None`` when the nodes could
    not be read, and then nothing is clamped)."""

    min_wanted: int
    max_wanted: int
    capacity: GroupCapacity | None

    @property
    def max_replicas(self) -> int:
        """The ScaledObject's ``maxReplicaCount``: maxReplicas, never above the group's capacity (and never
        below 1: KEDA and the HPA need one; a group holding none is said by :meth:`clamped`)."""
        if self.capacity is None:
            return self.max_wanted
        return max(1, min(self.max_wanted, self.capacity.replicas))

    @property
    def min_replicas(self) -> int:
        return min(self.min_wanted, self.max_replicas)

    def replicas(self, wanted: int) -> int:
        """What the StatefulSet runs for ``spec.dedicated.replicas`` = ``wanted``: never above
        :attr:`max_replicas` (an HPA decision taken before a node left, or a hand edit)."""
        return min(wanted, self.max_replicas)

    def clamped(self, tenant: str) -> str | None:
        """Why the pool may not grow to maxReplicas (it still serves), or ``None``."""
        capacity = self.capacity
        if capacity is None or capacity.replicas >= self.max_wanted:
            return None
        held = capacity.describe()
        return (
            f"spec.dedicated.autoscaling.maxReplicas is {self.max_wanted}, but {held}: Tenant {tenant}'s "
            f"pool scales between {self.min_replicas} and {self.max_replicas}. Add nodes to the group "
            f"(labelled and tainted kvfleet.io/gpu-group={capacity.group}), uncordon its nodes, or lower "
            "maxReplicas."
        )


def dedicated_engine_selector(namespace: str, model_deployment: str, pool: str) -> str:
    """A dedicated pool's engine pods (its StatefulSet's ``<name>-<ordinal>``)."""
    return f'namespace="{namespace}",pod=~"{engine_name(model_deployment, pool)}-[0-9]+"'


def build_dedicated_triggers(
    namespace: str, model_deployment: str, pool: str, tenant: Tenant, autoscaling: PoolAutoscaling
) -> list[Trigger]:
    """The dedicated pool's signals (see above), in a fixed order: queue, KV use, TTFT."""
    signals = autoscaling.signals
    gateway = gateway_selector(namespace, model_deployment)
    tier = tenant.spec.tier.value
    triggers: list[Trigger] = []
    target: int = getattr(signals.queue_per_replica, tier)
    if target > 0:
        queue = (
            f'sum({GATEWAY_QUEUE_DEPTH}{{{gateway},{POOL_LABEL}="{pool}",{SLA_TIER_LABEL}="{tier}"}})'
            " or vector(0)"
        )
        triggers.append(Trigger(f"queue-{tier}", queue, str(target), "AverageValue"))
    if signals.kv_usage > 0:
        engines = dedicated_engine_selector(namespace, model_deployment, pool)
        usage = f"sum({ENGINE_POOL_USED_BLOCKS}{{{engines}}}) / sum({ENGINE_POOL_BLOCKS}{{{engines}}})"
        triggers.append(
            Trigger("kv-usage", f"(({usage}) > -1) or vector(0)", _number(signals.kv_usage), "Value")
        )
    ttft = signals.ttft
    if ttft is not None and ttft.tier == tier:
        name = str(tenant.metadata["name"])
        buckets = f'{GATEWAY_TTFT_SECONDS}_bucket{{{gateway},{TENANT_LABEL}="{name}"}}'
        p99 = f"histogram_quantile(0.99, sum by (le) (rate({buckets}[{TTFT_WINDOW}])))"
        triggers.append(
            Trigger(f"ttft-{tier}", f"(({p99}) > -1) or vector(0)", _number(ttft.p99_seconds), "Value")
        )
    return triggers


def dedicated_scaling_unavailable(md: ModelDeployment, tenant: Tenant) -> str | None:
    """Why an autoscaled dedicated pool cannot have a ScaledObject whatever the cluster offers, or
    ``None``: its ModelDeployment names no Prometheus for KEDA to read."""
    if md.spec.pool.autoscaling.prometheus_address is not None:
        return None
    return (
        f"spec.dedicated.autoscaling is enabled, but ModelDeployment {md.metadata['name']} sets no "
        "spec.pool.autoscaling.prometheusAddress: KEDA reads a dedicated pool's signals from the "
        "ModelDeployment's Prometheus. Set that field on the ModelDeployment (spec.pool.autoscaling.enabled "
        "may stay false). Until then nothing scales this pool: spec.dedicated.replicas is what runs (within "
        "maxReplicas and what the group holds)."
    )


def build_dedicated_scaled_object(
    md: ModelDeployment, tenant: Tenant, pool: str, owner: Owner, scaling: DedicatedScaling
) -> Obj | None:
    """The ScaledObject of ``tenant``'s dedicated ``pool`` (owned by ``owner``, the Tenant), or ``None``
    when its autoscaling is off or the ModelDeployment names no Prometheus."""
    dedicated = tenant.spec.dedicated
    autoscaling = md.spec.pool.autoscaling
    address = autoscaling.prometheus_address
    if dedicated is None or not dedicated.autoscaling.enabled or address is None:
        return None
    namespace, name = str(md.metadata["namespace"]), str(md.metadata["name"])
    triggers = build_dedicated_triggers(namespace, name, pool, tenant, autoscaling)
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": SCALED_OBJECT,
        "metadata": metadata(engine_name(name, pool), namespace, object_labels(name, "engine", pool), owner),
        "spec": {
            "scaleTargetRef": {"apiVersion": owner.api_version, "kind": owner.kind, "name": owner.name},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": autoscaling.polling_interval_seconds,
            "triggers": [t.to_keda(address) for t in triggers],
        },
    }
