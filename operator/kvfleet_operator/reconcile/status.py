"""Status of ModelDeployments and Tenants, computed from what the reconcile saw. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvfleet_operator.api import ModelDeployment, ModelDeploymentStatus, Tenant, TenantStatus
from kvfleet_operator.api.modeldeployment import (
    GuaranteeStatus,
    KvCapacityStatus,
    TierCapacity,
    TieredCapacity,
)
from kvfleet_operator.api.tenant import ResolvedQuota
from kvfleet_operator.build.common import selector_labels
from kvfleet_operator.build.tenant_table import PoolCapacity, TenantDecision
from kvfleet_operator.reconcile.conditions import Condition, failed, merge_conditions, progressing, ready
from kvfleet_operator.reconcile.plan import is_subset

Obj = dict[str, Any]

# Reasons (one CamelCase word each; docs/operations.md lists what to do about each).
READY = "Ready"
WAITING_FOR_REPLICAS = "WaitingForReplicas"
INVALID_SPEC = "InvalidSpec"
CAPACITY_UNKNOWN = "CapacityUnknown"
MODEL_DEPLOYMENT_NOT_FOUND = "ModelDeploymentNotFound"
MODEL_DEPLOYMENT_NOT_READY = "ModelDeploymentNotReady"
MODEL_DEPLOYMENT_DELETING = "ModelDeploymentDeleting"
API_KEY_SECRET_NOT_FOUND = "ApiKeySecretNotFound"  # noqa: S105 - a condition reason
DELETION_BLOCKED = "DeletionBlockedByTenants"


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


def compute_model_deployment_status(
    md: ModelDeployment,
    capacity: PoolCapacity | None,
    decisions: Sequence[TenantDecision],
    engines: WorkloadReadiness,
    gateway: WorkloadReadiness,
    endpoint: str,
    problem: Condition | None,
    now: str,
) -> Obj:
    """The whole status of ``md`` as it goes on the wire (camelCase)."""
    generation = int(md.metadata.get("generation", 0))
    current = md.status.model_dump(by_alias=True, mode="json")["conditions"] if md.status else []
    name = str(md.metadata["name"])
    if problem is not None:
        updates = failed(problem.reason, problem.message)
    elif engines.is_ready and gateway.is_ready:
        updates = ready(READY, f"{engines.ready} engine replica(s) and the gateway serve {endpoint}.")
    else:
        updates = progressing(
            WAITING_FOR_REPLICAS,
            f"{engines.ready}/{engines.wanted} engine replicas and {gateway.ready}/{gateway.wanted} gateway "
            "replicas are ready.",
        )
    status = ModelDeploymentStatus(
        conditions=merge_conditions(current, updates, generation, now),
        observed_generation=generation,
        replicas=md.spec.pool.replicas,
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
            per_replica=per_replica, pool=pool, summary=_format_tokens(capacity.hbm_tokens * replicas)
        )
        shared = [d for d in decisions if d.admitted and d.quota is not None and d.pool == "shared"]
        hbm_blocks = sum(d.quota.hbm_blocks for d in shared if d.quota)
        share = Fraction(hbm_blocks, capacity.hbm_blocks) if capacity.hbm_blocks else Fraction(0)
        status.guaranteed = GuaranteeStatus(
            tenants=len(decisions),
            hbm_tokens=hbm_blocks * capacity.block_size,
            hbm_share=f"{float(share * 100):.4g}%",
            cpu_bytes=sum(d.quota.cpu_bytes for d in shared if d.quota),
            nvme_bytes=sum(d.quota.nvme_bytes for d in shared if d.quota),
        )
    return status.model_dump(by_alias=True, mode="json", exclude_none=True)


def compute_tenant_status(
    tenant: Tenant,
    decision: TenantDecision | None,
    capacity: PoolCapacity | None,
    problem: Condition | None,
    pool_ready: bool,
    endpoint: str,
    api_key_secret: str,
    now: str,
) -> Obj:
    """``problem`` (a dependency or spec issue) wins; else admission; else readiness of its pool."""
    generation = int(tenant.metadata.get("generation", 0))
    current = tenant.status.model_dump(by_alias=True, mode="json")["conditions"] if tenant.status else []
    resolved = ResolvedQuota()
    if problem is not None:
        updates = (
            progressing(problem.reason, problem.message)
            if problem.status == "Unknown"
            else failed(problem.reason, problem.message)
        )
    elif decision is None or not decision.admitted:
        reason = decision.reason if decision else INVALID_SPEC
        updates = failed(reason, decision.message if decision else "Not admitted.")
    elif pool_ready:
        updates = ready(
            READY, f"Admitted: {decision.message} Call {endpoint} with the key in {api_key_secret}."
        )
    else:
        updates = progressing(
            MODEL_DEPLOYMENT_NOT_READY, f"Admitted; waiting for its engines. {decision.message}"
        )
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
    status = TenantStatus(
        conditions=merge_conditions(current, updates, generation, now),
        observed_generation=generation,
        resolved_quota=resolved,
        endpoint=endpoint if admitted else "",
        api_key_secret_name=api_key_secret,
    )
    return status.model_dump(by_alias=True, mode="json", exclude_none=True)


def _ready(conditions: Sequence[Obj] | None) -> Obj:
    return next((c for c in conditions or [] if c.get("type") == "Ready"), {})


def compute_ready_event(obj: Obj, before: Sequence[Obj] | None, after: Sequence[Obj] | None) -> Obj | None:
    """A Kubernetes Event when the Ready condition flips or changes reason: what a human should notice
    (``kubectl describe`` shows it). ``None`` when nothing worth telling happened."""
    old, new = _ready(before), _ready(after)
    if not new or (old.get("status"), old.get("reason")) == (new.get("status"), new.get("reason")):
        return None
    meta = obj["metadata"]
    now = str(new.get("lastTransitionTime") or "")
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
        "type": "Normal" if new.get("status") == "True" else "Warning",
        "reason": new.get("reason", "Unknown"),
        "message": str(new.get("message", ""))[:1024],
        "source": {"component": "kvfleet-operator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def status_changed(current: Obj | None, desired: Obj) -> bool:
    """Whether writing ``desired`` would change anything (so a converged object is not written)."""
    return not is_subset(desired, current or {})
