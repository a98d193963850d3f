"""Who owns each dedicated GPU group, and which tolerations could reach one. Pure.

A dedicated GPU group (nodes labelled and tainted ``kvfleet.io/gpu-group=<group>``) belongs to exactly one
Tenant: the oldest Tenant, in any namespace the operator watches, whose ``spec.dedicated.gpuGroup`` names
it (``creationTimestamp``, then namespace, then name). ``gpuGroup`` is immutable (a CEL transition rule),
so a tenant claims a group only when it is created and a later claimant is always younger than the owner:
the owner keeps its group until it is deleted. Nothing is recorded anywhere; every reconcile of a
ModelDeployment with dedicated tenants lists the Tenants of the watched namespaces and derives the same
owners (:func:`gpu_group_owners`), so reconciles in different namespaces agree without coordinating.

A claim is what the API server accepted, served or not: a Tenant that is not admitted (quota, key,
missing ModelDeployment) still owns its group, so that its pods never find another tenant's KV there
once it is fixed. A claimant that is not the owner gets ``GpuGroupInUse`` naming the owner, and nothing
of it is built (:func:`refused_claimants`).

One window remains: creation timestamps have one-second resolution, so two claimants created in the same
second are ordered by namespace and name; if the later-sorting one was reconciled alone within that
second, its pool is built and then removed at the next reconcile that sees both.

The API server enforces the rest (the chart's ValidatingAdmissionPolicies, ``dedicated-gpu-groups.yaml``):
only the operator may create a workload whose pods tolerate or select a group, and only the StatefulSet
controller may create such a pod, labelled as a kvfleet dedicated engine pod. A shared pool whose
tolerations could admit a group's taint (:func:`tolerates_gpu_groups`) requires nodes without the label.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet_operator.api import Tenant
from kvfleet_operator.api.common import GPU_GROUP_LABEL
from kvfleet_runtime.config import Isolation

__all__ = ["GPU_GROUP_LABEL", "GroupClaim", "gpu_group_claims", "gpu_group_owners", "refused_claimants"]


@dataclass(frozen=True, order=True)
class GroupClaim:
    """One Tenant naming a dedicated GPU group. Claims order oldest first (the field order)."""

    created: str
    namespace: str
    name: str
    group: str

    @property
    def tenant(self) -> str:
        return f"{self.namespace}/{self.name}"


def gpu_group_claims(raw_tenants: Iterable[Mapping[str, Any]]) -> list[GroupClaim]:
    """The claims among Tenants as listed (any namespace): dedicated, naming a group, not being deleted.

    Reads the raw objects, so a Tenant whose spec the operator cannot serve still claims its group."""
    claims: list[GroupClaim] = []
    for raw in raw_tenants:
        meta = raw.get("metadata") or {}
        spec = raw.get("spec") or {}
        group = (spec.get("dedicated") or {}).get("gpuGroup")
        if spec.get("isolation") != Isolation.DEDICATED.value or not group or meta.get("deletionTimestamp"):
            continue
        claims.append(
            GroupClaim(
                created=str(meta.get("creationTimestamp") or ""),
                namespace=str(meta.get("namespace") or ""),
                name=str(meta.get("name") or ""),
                group=str(group),
            )
        )
    return claims


def gpu_group_owners(claims: Iterable[GroupClaim]) -> dict[str, GroupClaim]:
    """Group -> its owner: the oldest claim (creation time, then namespace, then name)."""
    owners: dict[str, GroupClaim] = {}
    for claim in sorted(set(claims)):
        owners.setdefault(claim.group, claim)
    return owners


def refused_claimants(tenants: Sequence[Tenant], owners: Mapping[str, GroupClaim]) -> dict[str, str]:
    """Tenant name -> why it may not use its GPU group (the message names the owner), for each of
    ``tenants`` (one namespace's, parsed) that claims a group another Tenant owns.

    A claimant missing from ``owners`` is not refused: ``owners`` should be computed from claims that
    include ``tenants`` themselves."""
    refused: dict[str, str] = {}
    for tenant in tenants:
        dedicated = tenant.spec.dedicated
        if dedicated is None:
            continue
        namespace, name = str(tenant.metadata.get("namespace", "")), str(tenant.metadata.get("name", ""))
        owner = owners.get(dedicated.gpu_group)
        if owner is None or (owner.namespace, owner.name) == (namespace, name):
            continue
        refused[name] = (
            f"GPU group {owner.group!r} belongs to Tenant {owner.tenant} (created {owner.created}, before "
            "this tenant): a dedicated GPU group serves one tenant. Delete this Tenant and recreate it "
            "with another spec.dedicated.gpuGroup (the field is immutable), or wait until the owner is "
            "deleted. Nothing was applied for this tenant."
        )
    return refused


def tolerates_gpu_groups(tolerations: Iterable[Mapping[str, Any]]) -> bool:
    """Whether any of ``tolerations`` (Kubernetes wire form) tolerates a dedicated group's taint: a
    wildcard (``operator: Exists`` without a key) or one on the group key."""
    for toleration in tolerations:
        key = toleration.get("key") or ""
        if key == GPU_GROUP_LABEL or (not key and toleration.get("operator") == "Exists"):
            return True
    return False
