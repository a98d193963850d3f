"""Status of ModelDeployments and Tenants, computed from what the reconcile saw. Pure.

Every status here is a new object built from the parsed models and the reconcile's decisions, never an
edit of an object as read: the shell compares it with the status it read (:func:`status_changed`) and
writes only what changed, so a converged object costs no write. The write is a server-side apply of the
whole status: a field left out of a new status is removed from the object.

A Tenant's ``status.admittedQuota`` is the memory of sticky admission (``build/tenant_table.py``): every
status computed here carries it forward unless admission itself decided otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from pydantic import ValidationError

from kvfleet_operator.api import ModelDeployment, ModelDeploymentStatus, Tenant, TenantStatus, reasons
from kvfleet_operator.api.common import CrdModel
from kvfleet_operator.api.modeldeployment import (
    GuaranteeStatus,
    KvCapacityStatus,
    TierCapacity,
    TieredCapacity,
)
from kvfleet_operator.api.tenant import ApiKeyFingerprints, ResolvedQuota
from kvfleet_operator.build.autoscaling import GuaranteeFloor, compute_guarantee_floor, shared_replicas
from kvfleet_operator.build.common import (
    SHARED_POOL,
    engine_name,
    epp_name,
    gateway_name,
    selector_labels,
    shared_tier_name,
)
from kvfleet_operator.build.endpoint_picker import runs_endpoint_picker
from kvfleet_operator.build.keys import KeyResolution, api_key_secret_ref
from kvfleet_operator.build.shared_tier import shared_tier_bytes
from kvfleet_operator.build.tenant_table import PoolCapacity, TenantDecision, admitted_terms, requested_terms
from kvfleet_operator.k8s import kinds
from kvfleet_operator.reconcile.capacity import EngineCapacity
from kvfleet_operator.reconcile.conditions import (
    DEGRADED,
    ConditionUpdate,
    failed,
    merge_conditions,
    progressing,
    ready,
)

Obj = dict[str, Any]


@dataclass(frozen=True)
class WorkloadReadiness:
    """Replicas wanted and ready, read from the live StatefulSet/Deployment status."""

    wanted: int
    ready: int

    @property
    def is_ready(self) -> bool:
        return self.ready >= self.wanted


def readiness_of(obj: Obj | None, wanted: int) -> WorkloadReadiness:
    ready_replicas = int(((obj or {}).get("status") or {}).get("readyReplicas") or 0)
    return WorkloadReadiness(wanted=wanted, ready=ready_replicas)


def shared_tier_readiness(md: ModelDeployment, children: Sequence[Obj]) -> WorkloadReadiness | None:
    """The shared KV tier's one server (``spec.kvCache.shared``), from its live Deployment; ``None`` when
    the ModelDeployment has no tier. The shared pool's replicas use it: no pool is ready without it."""
    if not shared_tier_bytes(md):
        return None
    return readiness_of(live_child(children, "Deployment", shared_tier_name(str(md.metadata["name"]))), 1)


def problem(reason: str, message: str) -> ConditionUpdate:
    """A problem that keeps an object from being served: ``Ready=False`` with ``reason``."""
    return ConditionUpdate("Ready", "False", reason, message)


def model_deployment_problem_for_tenant(md_problem: ConditionUpdate) -> ConditionUpdate:
    """What a tenant says while its ModelDeployment cannot be served, with the ModelDeployment's message.

    Its status ``Unknown`` (the tenant itself may be fine) makes :func:`compute_tenant_status` report
    progress (``Ready=False``, ``Progressing=True``) rather than a failure of the tenant."""
    return ConditionUpdate("Ready", "Unknown", reasons.MODEL_DEPLOYMENT_NOT_READY, md_problem.message)


def orphan_problem(model_deployment: str, *, deleting: bool) -> ConditionUpdate:
    """Why a tenant whose ModelDeployment is missing (or being deleted) cannot be served."""
    if deleting:
        return problem(
            reasons.MODEL_DEPLOYMENT_DELETING,
            f"ModelDeployment {model_deployment!r} is being deleted and waits for this tenant: delete the "
            "tenant or point spec.modelDeploymentRef at another ModelDeployment.",
        )
    return problem(
        reasons.MODEL_DEPLOYMENT_NOT_FOUND,
        f"ModelDeployment {model_deployment!r} does not exist in this namespace; create it or fix "
        "spec.modelDeploymentRef.name.",
    )


def compute_failure_status(
    raw: Obj, cause: ConditionUpdate | None, now: str, *, keep_admitted_quota: bool = False
) -> Obj:
    """Conditions and ``observedGeneration`` only, from the object as read (its spec may not even parse):
    the status of an object the operator cannot serve; the other fields go. With ``keep_admitted_quota``
    (a tenant whose key is refused keeps the room it was admitted with) ``admittedQuota`` stays."""
    status = raw.get("status") or {}
    generation = int(raw["metadata"].get("generation", 0))
    reason, message = (cause.reason, cause.message) if cause else (reasons.INVALID_SPEC, "Invalid spec.")
    out: Obj = {
        "conditions": merge_conditions(
            status.get("conditions") or [], failed(reason, message), generation, now
        ),
        "observedGeneration": generation,
    }
    if keep_admitted_quota and status.get("admittedQuota"):
        out["admittedQuota"] = status["admittedQuota"]
    return out


def _tier(tokens: int, nbytes: int, blocks: int = 0) -> TierCapacity:
    return TierCapacity(tokens=tokens, bytes=nbytes, blocks=blocks)


def _per_token(capacity: PoolCapacity, nbytes: int) -> int:
    return nbytes // capacity.offload_bytes_per_token if capacity.offload_bytes_per_token else 0


def _format_tokens(tokens: int) -> str:
    if tokens >= 1_000_000:
        return f"{tokens / 1_000_000:.1f}M tok"
    if tokens >= 1_000:
        return f"{tokens / 1_000:.0f}K tok"
    return f"{tokens} tok"


def unplaceable(message: str) -> list[ConditionUpdate]:
    """No node can run a pool's engine pods: not ready, still progressing (the pods start when a node
    fits), and degraded with the reason (``NoMatchingNodes``), which a human must act on."""
    return [u for u in progressing(reasons.NO_MATCHING_NODES, message) if u.type != DEGRADED] + [
        ConditionUpdate(DEGRADED, "True", reasons.NO_MATCHING_NODES, message)
    ]


def compute_model_deployment_status(
    md: ModelDeployment,
    capacity: PoolCapacity | None,
    decisions: Sequence[TenantDecision],
    engines: WorkloadReadiness,
    gateway: WorkloadReadiness,
    endpoint: str,
    problem: ConditionUpdate | None,
    now: str,
    placement: str | None = None,
    exposure: str | None = None,
    engine: EngineCapacity | None = None,
    capacity_note: str | None = None,
    shared_tier: WorkloadReadiness | None = None,
    store_note: str | None = None,
    autoscaling_note: str | None = None,
    floor: GuaranteeFloor | None = None,
) -> Obj:
    """The whole status of ``md`` as it goes on the wire (camelCase). ``placement``: why no node can run
    the shared pool's engine pods (``placement.compute_placement_problems``), reported while they are not
    all ready. ``exposure``: why the Ingress or HTTPRoute it asks for is not created
    (``steps.withhold_exposure``): ``Degraded`` says so unless something worse degrades it; ``Ready`` is
    the workloads' (the gateway still serves in the cluster). ``engine``: planned vs reported KV blocks
    (``reconcile/capacity.py``; ``capacity`` is already the figure admission used); ``capacity_note``: why
    the engines hold fewer blocks than planned (``CapacityBelowPlan``, ``Degraded`` like ``exposure``);
    ``shared_tier``: the shared KV tier's server, when there is one (``Ready`` waits for it too);
    ``store_note``: why the gateways' shared store does not serve (``SharedStoreUnreachable``, ``Degraded``
    like ``exposure``: the gateways fall back to their static shares); ``autoscaling_note``: why the KEDA
    ScaledObject ``spec.pool.autoscaling`` asks for is not created (``AutoscalingUnavailable``, the same).
    ``floor``: the shared pool's guarantee floor (``build/autoscaling.py``), in ``status.guaranteed``;
    a floor above autoscaling's maxReplicas is ``GuaranteeFloorUnmet`` (``Degraded`` like ``exposure``)."""
    generation = int(md.metadata.get("generation", 0))
    current = md.status.model_dump(by_alias=True, mode="json")["conditions"] if md.status else []
    name = str(md.metadata["name"])
    if problem is not None:
        updates = failed(problem.reason, problem.message)
    elif engines.is_ready and gateway.is_ready and (shared_tier is None or shared_tier.is_ready):
        updates = ready(reasons.READY, f"{engines.ready} engine replica(s) and the gateway serve {endpoint}.")
    elif placement is not None and not engines.is_ready:
        updates = unplaceable(placement)
    else:
        tier_down = shared_tier is not None and not shared_tier.is_ready
        updates = progressing(
            reasons.WAITING_FOR_REPLICAS,
            f"{engines.ready}/{engines.wanted} engine replicas and {gateway.ready}/{gateway.wanted} gateway "
            "replicas are ready" + ("; the shared KV tier is not." if tier_down else "."),
        )
    # Still serving, but degraded: the first of these that applies, unless something worse degrades it.
    notes = (
        (reasons.EXPOSURE_UNAVAILABLE, exposure),
        (reasons.CAPACITY_BELOW_PLAN, capacity_note),
        (reasons.SHARED_STORE_UNREACHABLE, store_note),
        (reasons.AUTOSCALING_UNAVAILABLE, autoscaling_note),
        (reasons.GUARANTEE_FLOOR_UNMET, floor.unmet(md.spec.pool.autoscaling) if floor is not None else None),
    )
    for reason, note in notes:
        if note is None or problem is not None:
            continue
        updates = [u for u in updates if u.type != DEGRADED or u.status == "True"]
        if not any(u.type == DEGRADED for u in updates):
            updates.append(ConditionUpdate(DEGRADED, "True", reason, note))
    status = ModelDeploymentStatus(
        conditions=merge_conditions(current, updates, generation, now),
        observed_generation=generation,
        replicas=md.spec.pool.replicas if floor is None else shared_replicas(md, floor),
        ready_replicas=engines.ready,
        selector=",".join(f"{k}={v}" for k, v in selector_labels(name, "engine", "shared").items()),
        endpoint=endpoint,
    )
    if capacity is not None:
        replicas = md.spec.pool.replicas
        per_replica = TieredCapacity(
            hbm=_tier(capacity.hbm_tokens, capacity.hbm_bytes, capacity.hbm_blocks),
            cpu=_tier(_per_token(capacity, capacity.cpu_bytes), capacity.cpu_bytes),
            nvme=_tier(_per_token(capacity, capacity.nvme_bytes), capacity.nvme_bytes),
        )
        pool = TieredCapacity(
            hbm=_tier(
                capacity.hbm_tokens * replicas, capacity.hbm_bytes * replicas, capacity.hbm_blocks * replicas
            ),
            cpu=_tier(_per_token(capacity, capacity.cpu_bytes) * replicas, capacity.cpu_bytes * replicas),
            nvme=_tier(_per_token(capacity, capacity.nvme_bytes) * replicas, capacity.nvme_bytes * replicas),
        )
        status.kv_capacity = KvCapacityStatus(
            planned_blocks=engine.planned_blocks if engine is not None else capacity.hbm_blocks,
            reported_blocks=engine.reported_blocks if engine is not None else None,
            per_replica=per_replica,
            pool=pool,
            summary=_format_tokens(capacity.hbm_tokens * replicas),
        )
        shared = [d for d in decisions if d.admitted and d.quota is not None and d.pool == SHARED_POOL]
        hbm_blocks = sum(d.quota.hbm_blocks for d in shared if d.quota)
        share = Fraction(hbm_blocks, capacity.hbm_blocks) if capacity.hbm_blocks else Fraction(0)
        status.guaranteed = GuaranteeStatus(
            tenants=len(decisions),
            hbm_tokens=hbm_blocks * capacity.block_size,
            hbm_share=f"{float(share * 100):.4g}%",
            cpu_bytes=sum(d.quota.cpu_bytes for d in shared if d.quota),
            nvme_bytes=sum(d.quota.nvme_bytes for d in shared if d.quota),
            seats=floor.seats if floor is not None else 0,
            replicas=floor.replicas if floor is not None else 0,
            waiting_seats=floor.waiting if floor is not None else 0,
        )
    return status.model_dump(by_alias=True, mode="json", exclude_none=True)


def _admitted_conditions(
    decision: TenantDecision,
    pool_ready: bool,
    endpoint: str,
    api_key_secret: str,
    placement: str | None = None,
) -> list[ConditionUpdate]:
    """An admitted tenant: ``Ready`` when its pool is; a refused quota change degrades it while it keeps
    serving at its admitted quota (``Ready`` stays ``True``, with the refusal as its reason). A dedicated
    pool no node can run (``placement``) says so (``NoMatchingNodes``) while it is not ready."""
    if placement is not None and not pool_ready:
        return unplaceable(f"Admitted; its dedicated pool cannot start. {placement}")
    if decision.refused is None:
        if pool_ready:
            return ready(
                reasons.READY,
                f"Admitted: {decision.message} Call {endpoint} with the key in {api_key_secret}.",
            )
        return progressing(
            reasons.MODEL_DEPLOYMENT_NOT_READY, f"Admitted; waiting for its engines. {decision.message}"
        )
    refused = f"Serving at its admitted quota: {decision.message} Change refused: {decision.refused}"
    if pool_ready:
        updates = ready(decision.reason, f"{refused} Call {endpoint} with the key in {api_key_secret}.")
    else:
        updates = progressing(
            reasons.MODEL_DEPLOYMENT_NOT_READY, f"Admitted; waiting for its engines. {refused}"
        )
    return [u for u in updates if u.type != DEGRADED] + [
        ConditionUpdate(DEGRADED, "True", decision.reason, refused)
    ]


def compute_tenant_status(
    tenant: Tenant,
    decision: TenantDecision | None,
    capacity: PoolCapacity | None,
    problem: ConditionUpdate | None,
    pool_ready: bool,
    endpoint: str,
    api_key_secret: str,
    now: str,
    keys: KeyResolution | None = None,
    placement: str | None = None,
    warning: ConditionUpdate | None = None,
) -> Obj:
    """``problem`` (a dependency or spec issue) wins; else admission; else readiness of its pool
    (``placement``: why no node can run its dedicated pool). ``warning``: a ``Degraded`` condition of an
    admitted tenant that is still served (its GPU group not bound yet), unless something worse degrades it.

    ``admittedQuota`` is what admission decided; without a decision (the ModelDeployment cannot be served
    now) it stays what it was. ``keys`` gives the fingerprints of the keys that serve the tenant.
    """
    generation = int(tenant.metadata.get("generation", 0))
    current = tenant.status.model_dump(by_alias=True, mode="json")["conditions"] if tenant.status else []
    resolved = ResolvedQuota()
    if problem is not None:
        updates = (
            progressing(problem.reason, problem.message)
            if problem.status == "Unknown"
            else failed(problem.reason, problem.message)
        )
    elif decision is not None and decision.reason == reasons.WAITING_FOR_CAPACITY:
        updates = progressing(decision.reason, decision.message)  # the pool scales out for it
    elif decision is None or not decision.admitted:
        reason = decision.reason if decision else reasons.INVALID_SPEC
        updates = failed(reason, decision.message if decision else "Not admitted.")
    else:
        updates = _admitted_conditions(decision, pool_ready, endpoint, api_key_secret, placement)
        if warning is not None and not any(u.type == DEGRADED and u.status == "True" for u in updates):
            updates = [u for u in updates if u.type != DEGRADED] + [warning]
    if decision is not None and decision.quota is not None and capacity is not None:
        q = decision.quota
        resolved = ResolvedQuota(
            hbm_blocks=q.hbm_blocks,
            hbm_tokens=q.hbm_blocks * capacity.block_size,
            hbm_bytes=(capacity.hbm_bytes // capacity.hbm_blocks) * q.hbm_blocks
            if capacity.hbm_blocks
            else 0,
            hbm_burst_blocks=q.hbm_burst_blocks,
            cpu_bytes=q.cpu_bytes,
            nvme_bytes=q.nvme_bytes,
        )
    admitted = decision is not None and decision.admitted and problem is None
    fingerprints = keys.fingerprints if keys is not None and admitted else ()
    status = TenantStatus(
        conditions=merge_conditions(current, updates, generation, now),
        observed_generation=generation,
        resolved_quota=resolved,
        endpoint=endpoint if admitted else "",
        api_key_secret_name=api_key_secret,
        api_key_fingerprints=ApiKeyFingerprints(
            current=fingerprints[0], previous=fingerprints[1] if len(fingerprints) > 1 else None
        )
        if fingerprints
        else None,
        requested_quota=requested_terms(tenant),
        admitted_quota=admitted_terms(tenant) if decision is None else decision.terms,
    )
    return status.model_dump(by_alias=True, mode="json", exclude_none=True)


#: The status model of each kind the operator writes status on.
STATUS_MODELS: dict[kinds.Kind, type[CrdModel]] = {
    kinds.MODEL_DEPLOYMENT: ModelDeploymentStatus,
    kinds.TENANT: TenantStatus,
}


@dataclass(frozen=True)
class StatusWrite:
    """One status the reconcile wants on one object; written only if :func:`status_changed` says so."""

    kind: kinds.Kind
    #: The object as read: its status is what ``status`` is compared with, and it names the object.
    raw: Obj
    status: Obj

    @property
    def changed(self) -> bool:
        return status_changed(self.raw.get("status"), self.status, STATUS_MODELS[self.kind])


def compute_unserved_statuses(
    model_deployment: str,
    raw_md: Obj | None,
    raw_tenants: Sequence[Obj],
    md_problem: ConditionUpdate | None,
    now: str,
) -> list[StatusWrite]:
    """Statuses when the ModelDeployment is not there to serve: missing or being deleted (each tenant
    says so), or its spec does not parse (the ModelDeployment says why; its tenants are left alone until
    it parses)."""
    if raw_md is None or (raw_md.get("metadata") or {}).get("deletionTimestamp"):
        cause = orphan_problem(model_deployment, deleting=raw_md is not None)
        return [
            StatusWrite(kinds.TENANT, raw, compute_failure_status(raw, cause, now)) for raw in raw_tenants
        ]
    return [StatusWrite(kinds.MODEL_DEPLOYMENT, raw_md, compute_failure_status(raw_md, md_problem, now))]


def live_child(children: Sequence[Obj], kind: str, name: str) -> Obj | None:
    """The child of ``kind`` named ``name`` among the live ``children``, or ``None``."""
    return next((o for o in children if o["kind"] == kind and o["metadata"]["name"] == name), None)


def front_door_readiness(md: ModelDeployment, children: Sequence[Obj]) -> WorkloadReadiness:
    """The gateway's replicas that serve: with an Endpoint Picker (the Envoy data plane, InferencePools),
    a gateway replica serves only with a picker replica beside it, so the fewer of the two."""
    name = str(md.metadata["name"])
    gateway = readiness_of(live_child(children, "Deployment", gateway_name(name)), md.spec.gateway.replicas)
    if not runs_endpoint_picker(md):
        return gateway
    picker = readiness_of(live_child(children, "Deployment", epp_name(name)), md.spec.gateway.replicas)
    return WorkloadReadiness(wanted=gateway.wanted, ready=min(gateway.ready, picker.ready))


def compute_tenant_pool_ready(
    md: ModelDeployment,
    tenant: Tenant,
    decision: TenantDecision | None,
    children: Sequence[Obj],
    dedicated_replicas: int | None = None,
    seated_replicas: int | None = None,
) -> bool:
    """Whether the pool that serves ``tenant`` is ready: the gateway, and the shared engines or the
    tenant's dedicated engines, from the live children's status. ``dedicated_replicas``: what its dedicated
    pool runs, where that is not spec.dedicated.replicas (autoscaling clamps it to its GPU group).
    ``seated_replicas``: on an autoscaled shared pool, the ready replicas that serve its admitted tenants
    (those their promised seats need, at least one): a scale-out under way, for load or for tenants waiting
    for capacity, does not make the admitted ones read not ready while the new replicas start."""
    name = str(md.metadata["name"])
    gateway = front_door_readiness(md, children)
    if decision is not None and decision.pool != SHARED_POOL:
        wanted = tenant.spec.dedicated.replicas if tenant.spec.dedicated else 1
        wanted = wanted if dedicated_replicas is None else dedicated_replicas
        engines = readiness_of(live_child(children, "StatefulSet", engine_name(name, decision.pool)), wanted)
    else:
        wanted = md.spec.pool.replicas if seated_replicas is None else seated_replicas
        engines = readiness_of(live_child(children, "StatefulSet", engine_name(name, SHARED_POOL)), wanted)
        tier = shared_tier_readiness(md, children)
        if tier is not None and not tier.is_ready:
            return False
    return engines.is_ready and gateway.is_ready


def compute_served_statuses(
    raw_md: Obj,
    md: ModelDeployment,
    capacity: PoolCapacity | None,
    decisions: Sequence[TenantDecision],
    md_problem: ConditionUpdate | None,
    endpoint: str,
    children: Sequence[Obj],
    raw_tenants: Mapping[str, Obj],
    tenants: Sequence[Tenant],
    tenant_problems: Mapping[str, ConditionUpdate],
    now: str,
    keys: Mapping[str, KeyResolution] | None = None,
    placement: Mapping[str, str] | None = None,
    exposure: str | None = None,
    engine: EngineCapacity | None = None,
    capacity_note: str | None = None,
    tenant_warnings: Mapping[str, ConditionUpdate] | None = None,
    store_note: str | None = None,
    autoscaling_note: str | None = None,
    dedicated_replicas: Mapping[str, int] | None = None,
) -> list[StatusWrite]:
    """The ModelDeployment's status, then each tenant's (in ``raw_tenants`` order), from the live
    ``children`` read by this reconcile: the next reconcile sees the effect of this one's writes.
    ``placement``: pool -> why no node can run its engine pods (``NoMatchingNodes`` on the
    ModelDeployment for the shared pool, on the owning Tenant for a dedicated one). ``exposure``: why the
    Ingress or HTTPRoute is not created (``ExposureUnavailable`` on the ModelDeployment). ``engine``,
    ``capacity_note``, ``store_note`` and ``autoscaling_note``: see :func:`compute_model_deployment_status`.
    ``tenant_warnings``:
    tenant -> its ``Degraded`` condition while it is served (:func:`compute_tenant_status`'s ``warning``).
    ``dedicated_replicas``: tenant -> the replicas its dedicated pool runs where autoscaling clamps them
    (``reconcile/group_capacity.py``); an admitted dedicated tenant's ``status.replicas`` and
    ``status.selector`` (its scale subresource) say what runs and which pods.

    A tenant in ``tenant_problems`` (its spec or key cannot be used) gets :func:`compute_failure_status`;
    every other tenant its full status, with the fingerprints of its keys (``keys``). While the
    ModelDeployment has a problem, its tenants wait on it.
    """
    keys = keys or {}
    placement = placement or {}
    name = str(md.metadata["name"])
    floor = compute_guarantee_floor(md, tenants, decisions)
    engines = readiness_of(
        live_child(children, "StatefulSet", engine_name(name, SHARED_POOL)), shared_replicas(md, floor)
    )
    gateway = front_door_readiness(md, children)
    writes = [
        StatusWrite(
            kinds.MODEL_DEPLOYMENT,
            raw_md,
            compute_model_deployment_status(
                md,
                capacity,
                decisions,
                engines,
                gateway,
                endpoint,
                md_problem,
                now,
                placement.get(SHARED_POOL),
                exposure,
                engine,
                capacity_note,
                shared_tier_readiness(md, children),
                store_note,
                autoscaling_note,
                floor,
            ),
        )
    ]
    parsed = {str(t.metadata["name"]): t for t in tenants}
    by_decision = {d.name: d for d in decisions}
    # Autoscaled: the admitted tenants are served once the replicas their seats need are ready.
    seated = None
    if md.spec.pool.autoscaling.enabled:
        seated = min(max(1, -(-floor.seats // floor.per_replica)), shared_replicas(md, floor))
    for tname, raw in raw_tenants.items():
        tenant = parsed.get(tname)
        if tenant is None:
            # A tenant whose key is refused keeps its admitted room; one whose spec does not parse does not.
            cause = tenant_problems.get(tname)
            keep = cause is not None and cause.reason != reasons.INVALID_SPEC
            status = compute_failure_status(raw, cause, now, keep_admitted_quota=keep)
            writes.append(StatusWrite(kinds.TENANT, raw, status))
            continue
        decision = by_decision.get(tname)
        cause = model_deployment_problem_for_tenant(md_problem) if md_problem is not None else None
        pool = _dedicated_pool_scale(md, tenant, decision, dedicated_replicas or {})
        pool_ready = compute_tenant_pool_ready(
            md, tenant, decision, children, None if pool is None else pool[0], seated
        )
        status = compute_tenant_status(
            tenant,
            decision,
            capacity,
            cause,
            pool_ready,
            endpoint,
            api_key_secret_ref(tenant)[0],
            now,
            keys.get(tname),
            placement.get(decision.pool) if decision is not None and decision.pool != SHARED_POOL else None,
            (tenant_warnings or {}).get(tname),
        )
        if pool is not None:
            status["replicas"], status["selector"] = pool
        writes.append(StatusWrite(kinds.TENANT, raw, status))
    return writes


def _dedicated_pool_scale(
    md: ModelDeployment, tenant: Tenant, decision: TenantDecision | None, replicas: Mapping[str, int]
) -> tuple[int, str] | None:
    """An admitted dedicated tenant's scale subresource: the replicas its pool runs and its engine pods'
    selector; ``None`` for every other tenant."""
    if decision is None or not decision.admitted or decision.pool == SHARED_POOL or not tenant.spec.dedicated:
        return None
    name = str(md.metadata["name"])
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(name, "engine", decision.pool).items())
    return replicas.get(decision.name, tenant.spec.dedicated.replicas), selector


def _condition(conditions: Sequence[Obj] | None, kind: str) -> Obj:
    return next((c for c in conditions or [] if c.get("type") == kind), {})


def _ready(conditions: Sequence[Obj] | None) -> Obj:
    return _condition(conditions, "Ready")


def _event(obj: Obj, condition: Obj, warning: bool) -> Obj:
    meta = obj["metadata"]
    now = str(condition.get("lastTransitionTime") or "")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace")},
        "involvedObject": {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "name": meta["name"],
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
        },
        "type": "Warning" if warning else "Normal",
        "reason": condition.get("reason", "Unknown"),
        "message": str(condition.get("message", ""))[:1024],
        "source": {"component": "kvfleet-operator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def _news(before: Obj, after: Obj) -> bool:
    return bool(after) and (before.get("status"), before.get("reason")) != (
        after.get("status"),
        after.get("reason"),
    )


def compute_ready_event(obj: Obj, before: Sequence[Obj] | None, after: Sequence[Obj] | None) -> Obj | None:
    """A Kubernetes Event when the Ready condition flips or changes reason: what a human should notice
    (``kubectl describe`` shows it). ``None`` when nothing worth telling happened."""
    old, new = _ready(before), _ready(after)
    if not _news(old, new):
        return None
    # A refused quota change keeps the tenant Ready but degraded: worth a warning all the same.
    degraded = _condition(after, DEGRADED).get("status") == "True"
    return _event(obj, new, warning=new.get("status") != "True" or degraded)


def compute_events(obj: Obj, before: Sequence[Obj] | None, after: Sequence[Obj] | None) -> list[Obj]:
    """The Events a status change is worth: :func:`compute_ready_event`, and a warning when the object
    becomes degraded for a reason Ready does not tell (a refused quota change of a tenant whose pool is
    still starting)."""
    events = [e for e in [compute_ready_event(obj, before, after)] if e is not None]
    old, new = _condition(before, DEGRADED), _condition(after, DEGRADED)
    told = {e["reason"] for e in events} | {_ready(after).get("reason")}
    if new.get("status") == "True" and _news(old, new) and new.get("reason") not in told:
        events.append(_event(obj, new, warning=True))
    return events


def is_waiting_for_pool(status: Obj) -> bool:
    """Whether a Tenant ``status`` says only that the tenant waits for its pool: ``Ready`` not true for
    ``ModelDeploymentNotReady`` while ``Progressing``, nothing degraded. Such a status may be held a few
    seconds in case the pool gets ready (``handlers/status_writer.py``)."""
    conditions = status.get("conditions")
    ready = _ready(conditions)
    return (
        ready.get("status") != "True"
        and ready.get("reason") == reasons.MODEL_DEPLOYMENT_NOT_READY
        and _condition(conditions, "Progressing").get("status") == "True"
        and _condition(conditions, DEGRADED).get("status") != "True"
    )


#: Events on a ModelDeployment telling, once per reconcile, what its tenants' Events of their pool would
#: tell one by one (:func:`told_on_model_deployment`): which tenants became Ready, which wait for it.
TENANTS_READY = "TenantsReady"
TENANTS_WAITING = "TenantsWaiting"
#: Tenants a summary Event names before it says how many more.
SUMMARY_NAMES = 20


def told_on_model_deployment(event: Obj) -> bool:
    """Whether a Tenant's Event is news of its pool rather than of the tenant: it became Ready (a Normal
    Event) or it waits for its ModelDeployment (``ModelDeploymentNotReady``). Those are told once per
    reconcile on the ModelDeployment (:func:`compute_tenant_summary_events`): ten thousand tenants starting
    with their pools must not write ten thousand Events each time. A tenant's own problems (a quota or a
    key refused, a GPU group in use) stay Warnings on the tenant."""
    return event.get("type") == "Normal" or event.get("reason") == reasons.MODEL_DEPLOYMENT_NOT_READY


def compute_tenant_summary_events(raw_md: Obj, told: Sequence[Obj], now: str) -> list[Obj]:
    """At most two Events on the ModelDeployment ``raw_md`` for the tenant Events ``told`` (those
    :func:`told_on_model_deployment` keeps off the tenants), naming the tenants: ``TenantsReady`` and
    ``TenantsWaiting``."""
    groups = {
        TENANTS_READY: sorted(
            str(e["involvedObject"]["name"])
            for e in told
            if e.get("reason") != reasons.MODEL_DEPLOYMENT_NOT_READY
        ),
        TENANTS_WAITING: sorted(
            str(e["involvedObject"]["name"])
            for e in told
            if e.get("reason") == reasons.MODEL_DEPLOYMENT_NOT_READY
        ),
    }
    what = {TENANTS_READY: "became Ready", TENANTS_WAITING: "wait for this ModelDeployment's pools"}
    events = []
    for reason, names in groups.items():
        if not names:
            continue
        shown = ", ".join(names[:SUMMARY_NAMES])
        more = f" and {len(names) - SUMMARY_NAMES} more" if len(names) > SUMMARY_NAMES else ""
        message = f"{len(names)} tenant(s) {what[reason]}: {shown}{more}."
        condition = {"reason": reason, "message": message, "lastTransitionTime": now}
        events.append(_event(raw_md, condition, warning=False))
    return events


def status_changed(current: Obj | None, desired: Obj, model: type[CrdModel]) -> bool:
    """Whether writing ``desired`` would change anything (so a converged object is not written).

    Compared as ``model`` (the kind's status model), so that the defaults the API server fills in are no
    change, while a field ``desired`` no longer has (the previous key's fingerprint after a rotation) is:
    the write removes it.
    """
    try:
        return model.model_validate(current or {}) != model.model_validate(desired)
    except ValidationError:
        return True
