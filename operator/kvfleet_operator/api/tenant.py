"""``Tenant`` (kvfleet.io/v1alpha1, short name ``tn``): who may use a ModelDeployment, and on what terms.

Isolation and a dedicated tenant's GPU group are immutable once set (transition rules): moving a tenant
between a shared pool and its own GPU group, or between groups, would leave KV behind in the old place,
so the tenant must be deleted and recreated instead. :func:`check_tenant_transition` is the pydantic-side
mirror of those rules. A GPU group belongs to whom the platform binds it to (``build/gpu_groups.py``);
an immutable group is what keeps that ownership stable: a tenant claims a group only when it is created.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator

from kvfleet_operator.api.common import (
    GPU_GROUP_LABEL,
    CelRule,
    Conditions,
    CrdModel,
    LabelName,
    LocalObjectReference,
    ObjectName,
    cel_rules_schema,
)
from kvfleet_operator.api.units import HbmAmount, PositiveDuration, Quantity, Share, parse_percent
from kvfleet_runtime.config import Isolation, SlaTier

KIND_TENANT = "Tenant"


class TenantKvQuota(CrdModel):
    """KV quota per tier. HBM is a guarantee (premium: a reservation); CPU and NVMe are byte caps."""

    hbm: HbmAmount = Field(
        default="0%",
        description="GPU-memory KV this tenant is guaranteed: a share of the pool (e.g. 20%) or a number "
        "of tokens (e.g. 500000).",
    )
    cpu: Quantity = Field(default="0", description="LMCache CPU-tier bytes this tenant may hold, e.g. 16Gi.")
    nvme: Quantity = Field(
        default="0", description="LMCache NVMe-tier bytes this tenant may hold, e.g. 200Gi."
    )


class TenantTtls(CrdModel):
    """Per-tier TTLs; an empty field takes the ModelDeployment's default (spec.kvCache.ttl)."""

    hbm: PositiveDuration | None = Field(default=None, description="GPU memory TTL, e.g. 30s.")
    cpu: PositiveDuration | None = Field(default=None, description="CPU tier TTL, e.g. 10m.")
    nvme: PositiveDuration | None = Field(default=None, description="NVMe tier TTL, e.g. 24h.")


class TenantRateLimits(CrdModel):
    """Admission limits at the gateway; empty means unlimited."""

    requests_per_minute: Annotated[
        int | None, Field(ge=1, le=10_000_000, description="Requests per minute, e.g. 600.")
    ] = None
    tokens_per_minute: Annotated[
        int | None, Field(ge=1, le=10_000_000_000, description="Prompt + completion tokens per minute.")
    ] = None
    max_concurrent: Annotated[
        int | None, Field(ge=1, le=100_000, description="Requests in flight at once.")
    ] = None


class ApiKeySecretRef(CrdModel):
    """The Secret holding the tenant's API key."""

    name: ObjectName = Field(description="Secret in this namespace; created with a random key if absent.")
    key: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            pattern=r"^[-._a-zA-Z0-9]+$",
            description="Key inside the Secret's data that holds the API key.",
        ),
    ] = "api-key"


RULE_GPU_GROUP_IMMUTABLE = CelRule(
    rule="self == oldSelf",
    message="spec.dedicated.gpuGroup is immutable: delete and recreate the Tenant to move it to another "
    "GPU group",
    transition=True,
)


RULE_DEDICATED_AUTOSCALING_BOUNDS = CelRule(
    # The has() guards: the API server also checks the rule against the field's default ({}).
    rule="!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
    message="spec.dedicated.autoscaling must satisfy minReplicas <= maxReplicas",
)


class DedicatedAutoscaling(CrdModel):
    """Autoscaling of the tenant's dedicated pool through KEDA, within its GPU group's nodes: the operator
    renders a ScaledObject whose HPA writes spec.dedicated.replicas through the Tenant's scale subresource.
    The signals, their targets and the Prometheus KEDA reads are the ModelDeployment's
    (spec.pool.autoscaling: prometheusAddress, signals, pollingIntervalSeconds), over this pool's series."""

    model_config = {"json_schema_extra": cel_rules_schema(RULE_DEDICATED_AUTOSCALING_BOUNDS)}

    enabled: bool = Field(
        default=False,
        description="true: KEDA sizes the dedicated pool between minReplicas and maxReplicas and owns "
        "spec.dedicated.replicas (leave it out of what you apply). maxReplicas is lowered to what the GPU "
        "group's schedulable nodes hold (MaxReplicasClamped says so).",
    )
    min_replicas: Annotated[int, Field(ge=1, le=1024, description="Fewest replicas.")] = 1
    max_replicas: Annotated[
        int,
        Field(ge=1, le=1024, description="Most replicas, and never more than the GPU group's nodes hold."),
    ] = 4

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(RULE_DEDICATED_AUTOSCALING_BOUNDS.message)
        return self


class DedicatedSettings(CrdModel):
    """Where a dedicated tenant's own engine pods run."""

    gpu_group: LabelName = Field(
        description=f"GPU node group: nodes labelled {GPU_GROUP_LABEL}=<this> and tainted for it, e.g. "
        "bank-h200. A group serves the Tenant the platform bound it to (chart value "
        "dedicatedGpuGroups.owners); any other claimant is refused (GpuGroupInUse, or GpuGroupNotBound for "
        "a group bound to nobody). Immutable.",
        json_schema_extra=cel_rules_schema(RULE_GPU_GROUP_IMMUTABLE),
    )
    replicas: Annotated[
        int, Field(ge=1, le=1024, description="Engine replicas of the dedicated pool (at least 1).")
    ] = 1
    autoscaling: DedicatedAutoscaling = Field(
        default_factory=DedicatedAutoscaling,
        description="Autoscaling of the dedicated pool through KEDA on the ModelDeployment's signals, "
        "within the GPU group's nodes.",
        json_schema_extra={"default": {}},
    )


RULE_ISOLATION_IMMUTABLE = CelRule(
    rule="self == oldSelf",
    message="spec.isolation is immutable: delete and recreate the Tenant to change its isolation",
    transition=True,
)
RULE_DEDICATED_REQUIRED = CelRule(
    rule="self.isolation != 'dedicated' || has(self.dedicated)",
    message="spec.dedicated (gpuGroup, replicas) is required when spec.isolation is dedicated",
    field_path=".dedicated",
    reason="FieldValueRequired",
)
RULE_DEDICATED_FORBIDDEN = CelRule(
    rule="self.isolation == 'dedicated' || !has(self.dedicated)",
    message="spec.dedicated is only for isolation: dedicated; remove it or change spec.isolation",
    field_path=".dedicated",
    reason="FieldValueForbidden",
)
RULE_BURST_COVERS_QUOTA = CelRule(
    rule="!has(self.kvQuota) || !has(self.kvQuota.hbm) || type(self.kvQuota.hbm) != string || "
    "double(self.burstLimit.replace('%', '')) >= double(self.kvQuota.hbm.replace('%', ''))",
    message="spec.burstLimit must be at least spec.kvQuota.hbm: raise burstLimit or lower the quota",
    field_path=".burstLimit",
)


class TenantSpec(CrdModel):
    """Desired state of a Tenant."""

    model_config = {
        "json_schema_extra": cel_rules_schema(
            RULE_DEDICATED_REQUIRED, RULE_DEDICATED_FORBIDDEN, RULE_BURST_COVERS_QUOTA
        )
    }

    model_deployment_ref: LocalObjectReference = Field(
        description="The ModelDeployment (same namespace) this tenant uses."
    )
    tier: SlaTier = Field(
        default=SlaTier.STANDARD,
        description="Service tier: premium, standard or basic. Sets request priority and eviction order.",
    )
    isolation: Isolation = Field(
        default=Isolation.SALTED,
        description="shared (reuses common prefixes with other shared tenants), salted (own cache salt on "
        "the shared pool; the default) or dedicated (own engine pods on own GPUs). Immutable.",
        json_schema_extra=cel_rules_schema(RULE_ISOLATION_IMMUTABLE),
    )
    kv_quota: TenantKvQuota = Field(
        default_factory=TenantKvQuota,
        description="KV quota per tier.",
        json_schema_extra={"default": {}},
    )
    burst_limit: Share = Field(
        default="50%",
        description="Most of the pool's GPU-memory KV this tenant may hold while others need room, e.g. 50%.",
    )
    fair_share_weight: Annotated[float, Field(ge=0.01, le=1000)] = Field(
        default=1.0,
        description="This tenant's weight in the gateway's fair queuing among tenants of its tier when the "
        "engines are saturated: a tenant of weight 2 is served twice the weighted tokens of a tenant of "
        "weight 1 (0.01 to 1000; default 1).",
    )
    ttl: TenantTtls = Field(
        default_factory=TenantTtls,
        description="Per-tier TTLs; empty fields take the ModelDeployment's defaults.",
        json_schema_extra={"default": {}},
    )
    rate_limits: TenantRateLimits = Field(
        default_factory=TenantRateLimits,
        description="Gateway admission limits.",
        json_schema_extra={"default": {}},
    )
    api_key_secret_ref: ApiKeySecretRef | None = Field(
        default=None,
        description="Secret with the tenant's API key; empty: the operator creates <tenant>-api-key.",
    )
    dedicated: DedicatedSettings | None = Field(
        default=None, description="Required when isolation is dedicated, forbidden otherwise."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.isolation == Isolation.DEDICATED and self.dedicated is None:
            raise ValueError(RULE_DEDICATED_REQUIRED.message)
        if self.isolation != Isolation.DEDICATED and self.dedicated is not None:
            raise ValueError(RULE_DEDICATED_FORBIDDEN.message)
        hbm = self.kv_quota.hbm
        if isinstance(hbm, str) and parse_percent(self.burst_limit) < parse_percent(hbm):
            raise ValueError(RULE_BURST_COVERS_QUOTA.message)
        return self


class ResolvedQuota(CrdModel):
    """The tenant's quota in the units the data plane counts in."""

    hbm_blocks: Annotated[int, Field(ge=0, description="Guaranteed GPU-memory KV blocks.")] = 0
    hbm_tokens: Annotated[int, Field(ge=0, description="Guaranteed GPU-memory KV tokens.")] = 0
    hbm_bytes: Annotated[int, Field(ge=0, description="Guaranteed GPU-memory KV bytes.")] = 0
    hbm_burst_blocks: Annotated[int, Field(ge=0, description="Most GPU-memory KV blocks under burst.")] = 0
    cpu_bytes: Annotated[int, Field(ge=0, description="CPU-tier bytes.")] = 0
    nvme_bytes: Annotated[int, Field(ge=0, description="NVMe-tier bytes.")] = 0


class QuotaTerms(CrdModel):
    """A quota in the units of ``spec`` (``spec.kvQuota`` and ``spec.burstLimit``): what a tenant asked for,
    or what it was admitted at."""

    hbm: HbmAmount = Field(description="Guaranteed GPU-memory KV: a share of the pool or a number of tokens.")
    cpu: Quantity = Field(description="LMCache CPU-tier bytes.")
    nvme: Quantity = Field(description="LMCache NVMe-tier bytes.")
    burst_limit: Share = Field(
        description="Most of the pool's GPU-memory KV the tenant may hold under burst."
    )


class ApiKeyFingerprints(CrdModel):
    """Fingerprints of the tenant's valid API keys: ``sha256:`` and the first 12 hex digits of the key's
    SHA-256, enough to tell keys apart during a rotation, never enough to recover or test a key."""

    current: Annotated[
        str, Field(max_length=64, description="Fingerprint of the key under the Secret's data key.")
    ] = ""
    previous: Annotated[
        str | None,
        Field(
            max_length=64, description="Fingerprint of the key under <data key>-previous, during a rotation."
        ),
    ] = None


class TenantStatus(CrdModel):
    """Observed state of a Tenant, written by the operator."""

    conditions: Conditions = []
    observed_generation: Annotated[
        int, Field(ge=0, description="The metadata.generation the operator last acted on.")
    ] = 0
    resolved_quota: ResolvedQuota = Field(
        default_factory=ResolvedQuota, description="Quota in blocks, tokens and bytes."
    )
    endpoint: Annotated[
        str, Field(max_length=512, description="OpenAI-compatible base URL to call with the API key.")
    ] = ""
    api_key_secret_name: Annotated[
        str, Field(max_length=253, description="Secret that holds this tenant's API key.")
    ] = ""
    api_key_fingerprints: ApiKeyFingerprints | None = Field(
        default=None,
        description="Fingerprints of the API keys the gateway accepts for this tenant (current and, during a "
        "rotation, previous).",
    )
    requested_quota: QuotaTerms | None = Field(
        default=None, description="The quota spec asks for (spec.kvQuota, spec.burstLimit)."
    )
    admitted_quota: QuotaTerms | None = Field(
        default=None,
        description="The quota the tenant was admitted at and is served with. It stays until the tenant's "
        "own edit is admitted or the tenant is deleted: an increase that does not fit leaves it unchanged "
        "(QuotaChangeRefused).",
    )
    replicas: Annotated[
        int | None,
        Field(
            ge=0,
            description="Dedicated tenants: engine replicas of the dedicated pool the operator runs "
            "(spec.dedicated.replicas, never more than the GPU group holds while autoscaling owns it; scale "
            "subresource).",
        ),
    ] = None
    selector: Annotated[
        str | None,
        Field(
            max_length=1024,
            description="Dedicated tenants: label selector of the dedicated pool's engine pods (scale "
            "subresource).",
        ),
    ] = None


class Tenant(CrdModel):
    """A tenant of a ModelDeployment: tier, isolation, KV quotas and TTLs, rate limits, API key."""

    api_version: Literal["kvfleet.io/v1alpha1"] = Field(
        default="kvfleet.io/v1alpha1", alias="apiVersion", description="kvfleet.io/v1alpha1"
    )
    kind: Literal["Tenant"] = Field(default="Tenant", description="Tenant")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: TenantSpec = Field(description="Desired state.")
    status: TenantStatus | None = Field(default=None, description="Observed state.")


class ImmutableFieldError(ValueError):
    """An update changes a field that is immutable once set; ``field`` is its wire path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_tenant_transition(old: Tenant, new: Tenant) -> None:
    """Raise :class:`ImmutableFieldError` when an update changes the isolation level or the GPU group."""
    if old.spec.isolation != new.spec.isolation:
        raise ImmutableFieldError("spec.isolation", RULE_ISOLATION_IMMUTABLE.message)
    before, after = old.spec.dedicated, new.spec.dedicated
    if before is not None and after is not None and before.gpu_group != after.gpu_group:
        raise ImmutableFieldError("spec.dedicated.gpuGroup", RULE_GPU_GROUP_IMMUTABLE.message)
