"""Every reason the operator puts on a condition: one CamelCase word a program can match on. Pure.

A reason is part of the API: users and their alerting match on it (``kubectl get tn -o
jsonpath='{..reason}'``), and every one appears in docs/operations.md ("Conditions and what to do"),
which a test keeps in step with :data:`CONDITION_REASONS`. Each constant's docstring says what it means
and what the user does about it. The condition types (``Ready``, ``Progressing``, ``Degraded``) live in
``kvfleet_operator.reconcile.conditions``.

This module sits in the API layer (it imports nothing) because the builders (admission) and the
reconcile (status) both set reasons, and the builders may not import the reconcile.
"""

from __future__ import annotations

from typing import Final

READY: Final = "Ready"
"""Serving (both kinds). The ModelDeployment's engines and gateway are ready; for a Tenant, it is admitted
and its pool is ready. Nothing to do."""

WAITING_FOR_REPLICAS: Final = "WaitingForReplicas"
"""ModelDeployment: engine or gateway replicas are not ready yet (``Progressing``). Wait; if it persists,
look at the pods (scheduling, image pulls, model loading)."""

MODEL_DEPLOYMENT_NOT_READY: Final = "ModelDeploymentNotReady"
"""Tenant (``Progressing``): admitted, but its pool is still starting; or its ModelDeployment cannot be
served yet, and the message is the ModelDeployment's. Wait, or fix the ModelDeployment's problem."""

QUOTA_EXCEEDS_CAPACITY: Final = "QuotaExceedsCapacity"
"""Tenant: its guarantee does not fit the pool next to the guarantees already admitted, or exceeds its own
burst limit; the message has the numbers and nothing of the tenant is applied. Lower ``spec.kvQuota``,
raise ``spec.burstLimit``, or add capacity."""

QUOTA_CHANGE_REFUSED: Final = "QuotaChangeRefused"
"""Tenant (``Degraded``; still serving): an edit of ``spec.kvQuota`` or ``spec.burstLimit`` could not be
admitted (the increase does not fit next to the other tenants' guarantees, or exceeds the burst limit), so
the tenant keeps serving at its previously admitted quota (``status.admittedQuota``; the message has the
numbers). Lower the request back, free capacity, or add capacity."""

API_KEY_SECRET_NOT_FOUND: Final = "ApiKeySecretNotFound"  # noqa: S105 - a condition reason, not a secret
"""Tenant: ``spec.apiKeySecretRef`` names a Secret that does not exist (or does not carry the tenant's
label, which hides it from the operator), or a data key it lacks. Create the Secret (or the key) and label
it ``kvfleet.io/tenant=<tenant>``, or remove ``spec.apiKeySecretRef`` to have one generated."""

API_KEY_SECRET_NOT_LABELLED: Final = "ApiKeySecretNotLabelled"  # noqa: S105 - a condition reason
"""Tenant: the Secret holding its API key is not marked for this tenant (label ``kvfleet.io/tenant`` is
missing or names another tenant), so its value does not become a key: a tenant cannot turn another
tenant's or any other Secret of the namespace into its key. Label it with the command in the message."""

API_KEY_TOO_WEAK: Final = "ApiKeyTooWeak"
"""Tenant: a key in its Secret (current or previous) is shorter than 32 characters, has fewer than 128 bits
by the entropy estimate, or is not a bearer token (letters, digits, ``-._~+/``, ``=`` padding); it is not
accepted. Put a random key there, e.g. ``openssl rand -hex 32``."""

API_KEY_SHARED: Final = "ApiKeyShared"
"""Tenant: another tenant of the same ModelDeployment has the same API key (the message names it); the
gateway could not tell them apart, so the key is refused for both and neither is served with it. Give one
of them a new key (rotation recipe in docs/operations.md)."""

GPU_GROUP_IN_USE: Final = "GpuGroupInUse"
"""Tenant: ``spec.dedicated.gpuGroup`` names a GPU group the platform bound to someone else (chart value
``dedicatedGpuGroups.owners``), or, within a namespace binding, one an older Tenant there owns; the message
names it. A group serves one tenant, so nothing of this one is applied. Use a group bound to this tenant
(delete and recreate it: the field is immutable), or ask the platform team to change the binding."""

GPU_GROUP_NOT_BOUND: Final = "GpuGroupNotBound"
"""Tenant: ``spec.dedicated.gpuGroup`` names a GPU group the platform bound to no owner (chart value
``dedicatedGpuGroups.owners``): nothing of it is built. A platform administrator binds the group to the
tenant's namespace (``<namespace>``) or to the tenant (``<namespace>/<tenant>``). After an upgrade, a
tenant whose pool already runs on an unbound group keeps it (``Degraded``, still serving) until the group
is bound."""

NAME_IN_USE: Final = "NameInUse"
"""ModelDeployment or Tenant: an object the operator would create under its name (the message names kind,
namespace, name and who owns it) exists already and is not this ModelDeployment's (no controller owner
reference with its uid): the operator never writes over it. On a ModelDeployment nothing of it is
written; on a dedicated Tenant nothing of that tenant is. Delete or rename the object in the way, or
rename the ModelDeployment or Tenant."""

MODEL_DEPLOYMENT_NOT_FOUND: Final = "ModelDeploymentNotFound"
"""Tenant: ``spec.modelDeploymentRef`` names no ModelDeployment in the tenant's namespace. Fix the name
or create the ModelDeployment."""

MODEL_DEPLOYMENT_DELETING: Final = "ModelDeploymentDeleting"
"""Tenant: its ModelDeployment is being deleted and waits for its tenants (a finalizer holds it). Delete
the tenant or point ``spec.modelDeploymentRef`` at another ModelDeployment."""

WAITING_FOR_CAPACITY: Final = "WaitingForCapacity"
"""Tenant (``Progressing``; not served yet): the ModelDeployment autoscales (``spec.pool.autoscaling``) and
the tenant's guaranteed concurrency (premium or standard, ``rateLimits.maxConcurrent``) does not fit the
seats of the shared pool's ready replicas beside what tenants admitted before are promised. Its seats count
in the guarantee floor, so the pool scales out for it (up to ``maxReplicas``); it is admitted when those
replicas are ready, premium before standard, then oldest first. Its KV quota is kept for it meanwhile.
Nothing to do but wait; the message gives the seats and replicas."""

CONCURRENCY_EXCEEDS_CAPACITY: Final = "ConcurrencyExceedsCapacity"
"""Tenant (``Degraded``; not served): on an autoscaled ModelDeployment, the tenant's guaranteed concurrency
(``rateLimits.maxConcurrent``) does not fit even at ``spec.pool.autoscaling.maxReplicas`` beside what the
tenants admitted before and those waiting ahead of it are promised. Nothing was applied for it. Raise
maxReplicas (or ``spec.gateway.engineInFlightPerReplica``), or lower the tenant's ``maxConcurrent``."""

CAPACITY_UNKNOWN: Final = "CapacityUnknown"
"""ModelDeployment: the pool cannot be sized (the model does not fit, no ``spec.pool.gpuMemory``, a CPU
engine without ``spec.pool.cpuKvCacheSpace``), so no tenant can be admitted. Follow the message;
``kvfleet plan`` reproduces it."""

CAPACITY_BELOW_PLAN: Final = "CapacityBelowPlan"
"""ModelDeployment (``Degraded``; still serving): vLLM allocated fewer KV blocks per replica than the
planner estimated (``status.kvCapacity.reportedBlocks`` < ``plannedBlocks``: activations, CUDA graphs or
workspaces took more than ``spec.pool.reservePerGpu``). Quotas are now admitted against the reported
figure; tenants admitted before keep theirs (sticky), and the message says whether their guarantees still
fit. Raise ``spec.pool.reservePerGpu`` so the estimate matches (the message gives the blocks), or lower
quotas that no longer fit."""

AUTOSCALING_UNAVAILABLE: Final = "AutoscalingUnavailable"
"""ModelDeployment (``Degraded``; still serving): ``spec.pool.autoscaling`` asks for a KEDA ScaledObject, but
the chart grants the operator no rights on scaledobjects (``rbac.keda``) or the cluster runs no KEDA
(keda.sh/v1alpha1 is not served); the message says which. Nothing scales the pool meanwhile:
``spec.pool.replicas`` is what runs. Tenant (``Degraded``; still serving): the same for its dedicated pool's
``spec.dedicated.autoscaling``, or its ModelDeployment sets no ``spec.pool.autoscaling.prometheusAddress``
(the Prometheus KEDA reads a dedicated pool's signals from); ``spec.dedicated.replicas`` is what runs."""

MAX_REPLICAS_CLAMPED: Final = "MaxReplicasClamped"
"""Tenant (``Degraded``; still serving): ``spec.dedicated.autoscaling.maxReplicas`` is more than the tenant's
GPU group holds (its Ready, uncordoned nodes that can run the pool's pods: their GPUs over
``gpusPerReplica``, or the CPU and memory requests where those are scarcer), so the ScaledObject's maximum
and the StatefulSet's replicas are clamped to what it holds; the message gives the figures. Add nodes to the
group, uncordon them, or lower maxReplicas."""

GROUP_CAPACITY_UNKNOWN: Final = "GroupCapacityUnknown"
"""Tenant (``Degraded``; still serving): its dedicated pool autoscales, but the operator may not list nodes
(the chart's ``rbac.readNodes`` is off), so what its GPU group holds is unknown and maxReplicas is not
clamped to it: replicas beyond what the group holds stay Pending. Turn ``rbac.readNodes`` on."""

GUARANTEE_FLOOR_UNMET: Final = "GuaranteeFloorUnmet"
"""ModelDeployment (``Degraded``; still serving): the concurrency the guaranteed tiers' admitted tenants are
promised (their ``rateLimits.maxConcurrent``, summed) needs more engine replicas than autoscaling may run
(``spec.pool.autoscaling.maxReplicas``; ``status.guaranteed.replicas`` is the floor, ``seats`` the
concurrency). Requests past what the pool seats wait at the gateway. Raise maxReplicas, or lower those
tenants' ``maxConcurrent``."""

SHARED_STORE_UNREACHABLE: Final = "SharedStoreUnreachable"
"""ModelDeployment (``Degraded``; still serving): the gateways' shared store (the chart's
``gatewaySharedStore``) does not answer the operator, or refuses its password (the message says which), so
the gateway replicas enforce their static 1/replicas share of every tenant's rate limits: a tenant whose
traffic lands on one replica gets less than its limit. No request fails. Bring the store back, or fix the
URL or the password Secret (a new password reaches the operator and the gateways when it restarts)."""

NO_MATCHING_NODES: Final = "NoMatchingNodes"
"""ModelDeployment (its shared pool) or Tenant (its dedicated pool), ``Degraded`` while still
``Progressing``: no node can run the engine pods (no node carries the pool's node-selector labels, e.g.
``kvfleet.io/gpu-pool=shared`` or the GPU Feature Discovery label ``nvidia.com/gpu.product``, or a
dedicated group's ``kvfleet.io/gpu-group``; a taint is not tolerated; no node has the GPU resource or
enough of it). The message names the selector and how many nodes lack each label, taint or resource; the
pods stay Pending and start when a node fits. Label, taint or equip the nodes (docs/operations.md,
Prerequisites)."""

GUARDRAIL_REFUSED: Final = "GuardrailRefused"
"""ModelDeployment: a field asks for something the platform does not allow (the chart's ``guardrails``: an
image outside the allowed registries, a host path outside the allowed roots, a vLLM flag that is not a
tuning flag, a ``system-*`` priority class, a Service type, annotation, ingress class, host or parent
Gateway not on the lists); the message names each field. The operator writes nothing for it: no child is
created, changed or deleted, so pods it already runs keep running (an upgrade that now refuses a
ModelDeployment stops nothing). Fix the field, or ask the platform team to allow it."""

EXPOSURE_UNAVAILABLE: Final = "ExposureUnavailable"
"""ModelDeployment (``Degraded``; still serving in the cluster): ``spec.gateway.exposure`` asks for an
Ingress or an HTTPRoute, or ``spec.gateway.inferencePool`` for InferencePools, that the operator may not
manage (the chart's ``rbac.ingress`` / ``rbac.httpRoute`` / ``rbac.inferencePool`` is off) or the cluster
does not serve (no Gateway API CRDs, no InferencePool CRD), so it is not created: ``status.endpoint``
stays the in-cluster URL, and without InferencePools no NetworkPolicy admits the platform gateway and an
HTTPRoute goes to the gateway Service. Turn the chart value on, or install the CRDs (the message says
which), or remove the field."""

INVALID_SPEC: Final = "InvalidSpec"
"""Both kinds: the API server accepted a spec the operator cannot serve (the message names the fields).
Follow the message."""

#: Every reason that can appear on a condition, in the order docs/operations.md lists them.
CONDITION_REASONS: Final = (
    READY,
    WAITING_FOR_REPLICAS,
    MODEL_DEPLOYMENT_NOT_READY,
    QUOTA_EXCEEDS_CAPACITY,
    QUOTA_CHANGE_REFUSED,
    WAITING_FOR_CAPACITY,
    CONCURRENCY_EXCEEDS_CAPACITY,
    API_KEY_SECRET_NOT_FOUND,
    API_KEY_SECRET_NOT_LABELLED,
    API_KEY_TOO_WEAK,
    API_KEY_SHARED,
    GPU_GROUP_IN_USE,
    GPU_GROUP_NOT_BOUND,
    NAME_IN_USE,
    MODEL_DEPLOYMENT_NOT_FOUND,
    MODEL_DEPLOYMENT_DELETING,
    CAPACITY_UNKNOWN,
    CAPACITY_BELOW_PLAN,
    SHARED_STORE_UNREACHABLE,
    AUTOSCALING_UNAVAILABLE,
    MAX_REPLICAS_CLAMPED,
    GROUP_CAPACITY_UNKNOWN,
    GUARANTEE_FLOOR_UNMET,
    NO_MATCHING_NODES,
    GUARDRAIL_REFUSED,
    EXPOSURE_UNAVAILABLE,
    INVALID_SPEC,
)

ADMITTED: Final = "Admitted"
"""The reason of an admission decision that admits a tenant. Never on a condition: an admitted tenant's
conditions say ``Ready`` or ``ModelDeploymentNotReady`` (whether its pool is ready)."""
