"""How many replicas of a dedicated pool its GPU group's nodes hold, and what that bounds. Pure.

A dedicated tenant that autoscales (``spec.dedicated.autoscaling``) scales within its GPU group's nodes
only. Its pods cannot leave the group (required node label, toleration of the group's taint), and this
module says how far the group lets it grow, so that neither KEDA's HPA nor a hand edit asks for replicas
that would stay Pending (the tenant table would list them to the gateways).

A group's capacity is counted from the nodes' allocatable resources, not from what is free now: the pool's
own pods are on those nodes, and a full group is the pool at its capacity. A node counts when it carries
the group's label, is Ready, is not cordoned and can run the pool's pod at all (its selector, affinity and
taints: ``placement.compute_unmet``); it holds as many replicas as the scarcest of the pod's requests
allows, ``floor(allocatable / request)``, and at most its allocatable ``pods``. For a GPU engine the GPUs
are the scarce resource (``floor(GPUs / gpusPerReplica)``) unless a large LMCache CPU tier makes memory
so; a CPU engine (``gpusPerReplica: 0``) is counted by its CPU and memory requests in the same way, not as
one replica per node: that is what the scheduler places.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from kvfleet_operator.api import ModelDeployment, Tenant, reasons
from kvfleet_operator.api.common import GPU_GROUP_LABEL
from kvfleet_operator.build.autoscaling import DedicatedScaling, GroupCapacity, dedicated_scaling_unavailable
from kvfleet_operator.reconcile.conditions import DEGRADED, ConditionUpdate
from kvfleet_operator.reconcile.placement import compute_unmet, resource_amount

__all__ = [
    "compute_group_capacity",
    "node_ready",
    "plan_dedicated_scaling",
    "pod_requests",
    "replicas_by_tenant",
    "replicas_on_node",
]

Obj = dict[str, Any]


def node_ready(node: Obj) -> bool:
    """Whether the node's ``Ready`` condition is ``True``."""
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_requests(pod: Obj) -> dict[str, Decimal]:
    """What scheduling ``pod`` (a pod spec) takes of a node: per resource, the containers' requests summed,
    or an init container's if it asks for more (init containers run one at a time, before the others)."""
    total: dict[str, Decimal] = {}
    for container in pod.get("containers") or []:
        for name, amount in ((container.get("resources") or {}).get("requests") or {}).items():
            total[name] = total.get(name, Decimal(0)) + resource_amount(amount)
    for container in pod.get("initContainers") or []:
        for name, amount in ((container.get("resources") or {}).get("requests") or {}).items():
            total[name] = max(total.get(name, Decimal(0)), resource_amount(amount))
    return {name: amount for name, amount in total.items() if amount > 0}


def _schedulable(pod: Obj, node: Obj) -> bool:
    return node_ready(node) and not compute_unmet(pod, node)


def replicas_on_node(pod: Obj, node: Obj) -> int:
    """How many of ``pod`` the node holds: 0 unless it is Ready and can run the pod at all, else the fewest
    any request allows (and its ``pods`` allocatable)."""
    if not _schedulable(pod, node):
        return 0
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    fits = [
        int(resource_amount(allocatable.get(name, 0)) // amount) for name, amount in pod_requests(pod).items()
    ]
    if "pods" in allocatable:
        fits.append(int(resource_amount(allocatable["pods"])))
    return min(fits, default=0)


def compute_group_capacity(
    group: str, pod: Obj, nodes: Sequence[Obj], gpu_resource: str, gpus_per_replica: int
) -> GroupCapacity:
    """What the nodes labelled ``kvfleet.io/gpu-group=<group>`` among ``nodes`` hold of ``pod`` (a
    dedicated pool's pod spec, as the operator applies it)."""
    replicas = schedulable = gpus = 0
    for node in nodes:
        if ((node.get("metadata") or {}).get("labels") or {}).get(GPU_GROUP_LABEL) != group:
            continue
        if not _schedulable(pod, node):
            continue
        schedulable += 1
        replicas += replicas_on_node(pod, node)
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        gpus += int(resource_amount(allocatable.get(gpu_resource, 0)))
    return GroupCapacity(group, replicas, schedulable, gpus, gpu_resource, gpus_per_replica)


def _unavailable(message: str) -> ConditionUpdate:
    return ConditionUpdate(DEGRADED, "True", reasons.AUTOSCALING_UNAVAILABLE, message)


def plan_dedicated_scaling(
    md: ModelDeployment,
    pools: Sequence[tuple[Tenant, Obj]],
    nodes: Sequence[Obj] | None,
    *,
    managed: bool,
    served: bool,
) -> tuple[dict[str, DedicatedScaling], dict[str, ConditionUpdate]]:
    """For each autoscaled dedicated tenant in ``pools`` (with its pool's pod spec): its bounds (by tenant
    name), and, where autoscaling does not work as asked, the ``Degraded`` condition that says why
    (the tenant still serves):

    * ``AutoscalingUnavailable``: the ModelDeployment names no Prometheus, the operator may not manage
      ScaledObjects (``managed``: the chart's ``rbac.keda``) or the cluster runs no KEDA (``served``);
      nothing scales the pool, ``spec.dedicated.replicas`` runs;
    * ``GroupCapacityUnknown``: ``nodes`` is ``None`` (the operator may not list nodes, ``rbac.readNodes``):
      the pool autoscales up to maxReplicas, unclamped;
    * ``MaxReplicasClamped``: the group holds fewer replicas than maxReplicas: the pool scales up to what
      it holds.
    """
    scaling: dict[str, DedicatedScaling] = {}
    notes: dict[str, ConditionUpdate] = {}
    for tenant, pod in pools:
        dedicated = tenant.spec.dedicated
        if dedicated is None or not dedicated.autoscaling.enabled:
            continue
        name = str(tenant.metadata["name"])
        capacity = (
            None
            if nodes is None
            else compute_group_capacity(
                dedicated.gpu_group, pod, nodes, md.spec.pool.gpu_resource, md.spec.pool.gpus_per_replica
            )
        )
        bounds = scaling[name] = DedicatedScaling(
            dedicated.autoscaling.min_replicas, dedicated.autoscaling.max_replicas, capacity
        )
        why = dedicated_scaling_unavailable(md, tenant)
        until = (
            "Until then nothing scales this pool: spec.dedicated.replicas is what runs (within maxReplicas "
            "and what the group holds)."
        )
        if why is not None:
            notes[name] = _unavailable(why)
        elif not managed:
            notes[name] = _unavailable(
                "spec.dedicated.autoscaling asks for a ScaledObject, but this operator may not manage "
                f"scaledobjects: install the chart with rbac.keda=true. {until}"
            )
        elif not served:
            notes[name] = _unavailable(
                "spec.dedicated.autoscaling asks for a ScaledObject, but the cluster does not serve "
                f"keda.sh/v1alpha1: install KEDA (v2.21 or later; docs/operations.md, Autoscaling). {until}"
            )
        elif capacity is None:
            notes[name] = ConditionUpdate(
                DEGRADED,
                "True",
                reasons.GROUP_CAPACITY_UNKNOWN,
                f"the operator may not list nodes (the chart's rbac.readNodes), so what GPU group "
                f"{dedicated.gpu_group} holds is unknown: the pool autoscales up to maxReplicas "
                f"({dedicated.autoscaling.max_replicas}) unclamped, and replicas beyond what the group "
                "holds stay Pending (they never leave the group's nodes).",
            )
        elif (clamped := bounds.clamped(name)) is not None:
            notes[name] = ConditionUpdate(DEGRADED, "True", reasons.MAX_REPLICAS_CLAMPED, clamped)
    return scaling, notes


def replicas_by_tenant(tenants: Sequence[Tenant], scaling: Mapping[str, DedicatedScaling]) -> dict[str, int]:
    """The replicas each dedicated tenant's pool runs: ``spec.dedicated.replicas``, clamped by its bounds
    when it autoscales (``status.replicas``, the scale subresource's)."""
    out: dict[str, int] = {}
    for tenant in tenants:
        if tenant.spec.dedicated is None:
            continue
        name = str(tenant.metadata["name"])
        wanted = tenant.spec.dedicated.replicas
        out[name] = scaling[name].replicas(wanted) if name in scaling else wanted
    return out
