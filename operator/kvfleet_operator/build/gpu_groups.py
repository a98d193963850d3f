"""Who owns each dedicated GPU group, and which tolerations could reach one. Pure.

A dedicated GPU group (nodes labelled and tainted ``kvfleet.io/gpu-group=<group>``) belongs to whom the
platform binds it to: the chart value ``dedicatedGpuGroups.owners`` maps each group to a namespace
(``<namespace>``: any Tenant there may claim it) or to one Tenant (``<namespace>/<tenant>``), and reaches
the operator as ``KVFLEET_GPU_GROUP_OWNERS`` (:func:`parse_gpu_group_owners`). Creating a Tenant grants
nothing: a Tenant naming a group bound elsewhere gets ``GpuGroupInUse`` naming the binding, one naming a
group bound to nobody gets ``GpuGroupNotBound`` naming the chart value to set, and nothing of either is
built (:func:`decide_gpu_group_claims`). Before bindings, the first Tenant to name a group owned it, so a
team could squat a group before the bank asked for it; a binding cannot be taken that way.

Within a binding, one Tenant serves a group: the oldest claimant the binding admits (``creationTimestamp``,
then namespace, then name; :func:`gpu_group_owners`), which matters for a namespace binding only.
``gpuGroup`` is immutable (a CEL transition rule), so a later claimant is always younger than the owner.
Nothing is recorded anywhere; every reconcile of a ModelDeployment with dedicated tenants lists the Tenants
of the watched namespaces and derives the same owners, so reconciles in different namespaces agree without
coordinating. A claim is what the API server accepted, served or not: a Tenant that is not admitted
(quota, key) still owns its group, so that its pods never find another tenant's KV there once it is fixed.

Upgrades: a group nobody bound yet keeps serving the tenant that owned it by the old rule (the oldest
claimant anywhere) as long as that tenant's pool already runs: it keeps its pods, with ``Degraded``
``GpuGroupNotBound`` saying which binding to set. A new pool is never built on an unbound group.

The API server enforces the rest (the chart's ValidatingAdmissionPolicies, ``dedicated-gpu-groups.yaml``):
only the operator may create a workload whose pods tolerate or select a group, and only the StatefulSet
controller may create such a pod, labelled as a kvfleet dedicated engine pod. A shared pool whose
tolerations could admit a group's taint (:func:`tolerates_gpu_groups`) requires nodes without the label.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet_operator.api import Tenant, reasons
from kvfleet_operator.api.common import DNS_LABEL_PATTERN, GPU_GROUP_LABEL
from kvfleet_runtime.config import Isolation

__all__ = [
    "GPU_GROUP_LABEL",
    "GPU_GROUP_OWNERS_VALUE",
    "GroupBinding",
    "GroupClaim",
    "GroupDecisions",
    "decide_gpu_group_claims",
    "gpu_group_claims",
    "gpu_group_owners",
    "parse_gpu_group_owners",
]

#: The chart value that binds groups to their owners (named in every message that asks for a binding).
GPU_GROUP_OWNERS_VALUE = "dedicatedGpuGroups.owners"
_LABEL = re.compile(DNS_LABEL_PATTERN)
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


@dataclass(frozen=True)
class GroupBinding:
    """Whom the platform bound a group to: every Tenant of ``namespace``, or only Tenant ``tenant`` there."""

    namespace: str
    tenant: str | None = None

    def admits(self, namespace: str, name: str) -> bool:
        return namespace == self.namespace and self.tenant in (None, name)

    def describe(self) -> str:
        if self.tenant is None:
            return f"namespace {self.namespace}"
        return f"Tenant {self.namespace}/{self.tenant}"


def parse_gpu_group_owners(text: str | None) -> dict[str, GroupBinding]:
    """``KVFLEET_GPU_GROUP_OWNERS`` (the chart value as JSON: ``{"<group>": "<namespace>[/<tenant>]"}``);
    unset or empty: no group is bound. Raises ``ValueError`` naming the entry that is malformed: a typo must
    stop the operator, never bind a group to someone nobody meant."""
    if not text:
        return {}
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{GPU_GROUP_OWNERS_VALUE}: expected a map of group to owner, got {raw!r}")
    bindings: dict[str, GroupBinding] = {}
    for group, owner in raw.items():
        namespace, slash, tenant = str(owner).partition("/")
        valid = (
            isinstance(owner, str)
            and _LABEL.match(str(group)) is not None
            and len(str(group)) <= 63
            and _LABEL.match(namespace) is not None
            and len(namespace) <= 63
            and (not slash or (_NAME.match(tenant) is not None and len(tenant) <= 253))
        )
        if not valid:
            raise ValueError(
                f"{GPU_GROUP_OWNERS_VALUE}.{group}: {owner!r} is not <namespace> or <namespace>/<tenant> "
                "(lowercase names), or the group is not a label value"
            )
        bindings[str(group)] = GroupBinding(namespace, tenant or None)
    return bindings


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


def gpu_group_owners(
    claims: Iterable[GroupClaim], bindings: Mapping[str, GroupBinding] | None = None
) -> dict[str, GroupClaim]:
    """Group -> its owner: the oldest claim (creation time, then namespace, then name) among those the
    group's binding admits; for a group without a binding (``bindings`` lacks it), among all claims (the
    rule before bindings, which only keeps an already running pool: :func:`decide_gpu_group_claims`)."""
    bindings = bindings or {}
    owners: dict[str, GroupClaim] = {}
    for claim in sorted(set(claims)):
        binding = bindings.get(claim.group)
        if binding is None or binding.admits(claim.namespace, claim.name):
            owners.setdefault(claim.group, claim)
    return owners


@dataclass
class GroupDecisions:
    """What :func:`decide_gpu_group_claims` decided for one namespace's dedicated tenants."""

    #: Tenant name -> (reason, message): nothing of it may be built.
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Tenant name -> message: it keeps its running pool on a group nobody bound yet (an upgrade), with
    #: ``Degraded`` ``GpuGroupNotBound`` saying which binding to set.
    unbound: dict[str, str] = field(default_factory=dict)


def _binding_value(group: str, namespace: str, name: str) -> str:
    return f"{GPU_GROUP_OWNERS_VALUE}.{group}={namespace}/{name} (or ={namespace} for every Tenant there)"


def decide_gpu_group_claims(
    tenants: Sequence[Tenant],
    claims: Iterable[GroupClaim],
    bindings: Mapping[str, GroupBinding],
    running: Collection[str] = (),
) -> GroupDecisions:
    """For each of ``tenants`` (one namespace's, parsed) that names a dedicated group: refused, kept on an
    unbound group, or (absent from both) the group's owner. ``claims``: every claim in the watched
    namespaces, ``tenants``' own included. ``running``: names of ``tenants`` whose dedicated pool already
    exists (its StatefulSet, controlled by the tenant): only those may stay on an unbound group."""
    claims = list(claims)
    owners = gpu_group_owners(claims, bindings)
    legacy = gpu_group_owners(claims)
    out = GroupDecisions()
    for tenant in tenants:
        dedicated = tenant.spec.dedicated
        if dedicated is None:
            continue
        group = dedicated.gpu_group
        namespace, name = str(tenant.metadata.get("namespace", "")), str(tenant.metadata.get("name", ""))
        binding = bindings.get(group)
        if binding is None:
            owner = legacy.get(group)
            is_owner = owner is not None and (owner.namespace, owner.name) == (namespace, name)
            if is_owner and name in running:
                out.unbound[name] = (
                    f"GPU group {group!r} is bound to no owner by the platform. This tenant's pool, which "
                    "already runs there, keeps running; a platform administrator binds the group with "
                    f"the chart value {_binding_value(group, namespace, name)}."
                )
                continue
            out.refused[name] = (
                reasons.GPU_GROUP_NOT_BOUND,
                f"GPU group {group!r} is bound to no owner: naming a group in a Tenant does not make it "
                "yours. A platform administrator binds it to this tenant with the chart value "
                f"{_binding_value(group, namespace, name)}. Nothing was applied for this tenant.",
            )
            continue
        if not binding.admits(namespace, name):
            out.refused[name] = (
                reasons.GPU_GROUP_IN_USE,
                f"GPU group {group!r} is bound to {binding.describe()} by the platform (chart value "
                f"{GPU_GROUP_OWNERS_VALUE}), not to this tenant. Use a group bound to it, or ask the "
                "platform team to bind one (the field is immutable: delete and recreate the Tenant). "
                "Nothing was applied for this tenant.",
            )
            continue
        owner = owners.get(group)
        if owner is not None and (owner.namespace, owner.name) != (namespace, name):
            out.refused[name] = (
                reasons.GPU_GROUP_IN_USE,
                f"GPU group {group!r} belongs to Tenant {owner.tenant} (created {owner.created}, before "
                f"this tenant; both in {binding.describe()}): a dedicated GPU group serves one tenant. "
                "Delete this Tenant and recreate it with another spec.dedicated.gpuGroup (the field is "
                "immutable), or wait until the owner is deleted. Nothing was applied for this tenant.",
            )
    return out


def tolerates_gpu_groups(tolerations: Iterable[Mapping[str, Any]]) -> bool:
    """Whether any of ``tolerations`` (Kubernetes wire form) tolerates a dedicated group's taint: a
    wildcard (``operator: Exists`` without a key) or one on the group key."""
    for toleration in tolerations:
        key = toleration.get("key") or ""
        if key == GPU_GROUP_LABEL or (not key and toleration.get("operator") == "Exists"):
            return True
    return False
