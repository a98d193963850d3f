"""One idempotent reconcile of a ModelDeployment and all its Tenants: read, build, plan, apply, status.

Every kopf handler (create, update, resume, timer, child events, tenant events) ends up here. The
function is level-triggered: it looks only at the current state of the world, never at what changed.
A converged ModelDeployment costs reads only; the counter on ``KubeClient`` proves it in tests.

Partial state is impossible by construction: a tenant that cannot be admitted (quota, missing Secret,
invalid spec) is left out of the desired state entirely, so nothing of it is applied, and it gets a
condition that says why.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvfleet_operator import metrics
from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.api.manifest import format_validation_error
from kvfleet_operator.build.common import (
    SHARED_POOL,
    engine_name,
    gateway_name,
    owned_selector,
)
from kvfleet_operator.build.model_deployment import (
    PREVIOUS_SUFFIX,
    OperatorImages,
    api_key_secret_ref,
    build_api_key_secret,
    build_desired_children,
    compute_endpoint,
)
from kvfleet_operator.build.tenant_table import (
    PoolCapacity,
    TenantDecision,
    admit_tenants,
    compute_pool_capacity,
)
from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.client import ApiError, KubeClient
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile.conditions import Condition, failed, merge_conditions, now_rfc3339
from kvfleet_operator.reconcile.plan import compute_plan
from kvfleet_runtime.config import KeyFile, hash_api_key
from kvfleet_runtime.kv.sizing import SizingError

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass(frozen=True)
class OperatorConfig:
    images: OperatorImages
    #: The operator's master key (from its own Secret); each ModelDeployment's salt key derives from it,
    #: so a deleted or edited keys Secret is restored with the same salts (no cache flush, no drift).
    salt_master: bytes
    #: Whether the cluster serves monitoring.coreos.com/v1 (checked once at start-up).
    monitoring: bool = False

    def salt_key_hex(self, md: ModelDeployment) -> str:
        meta = md.metadata
        ident = f"{meta.get('namespace')}/{meta.get('name')}/{meta.get('uid', '')}"
        return hmac.new(self.salt_master, ident.encode(), hashlib.sha256).hexdigest()


@dataclass
class ReconcileResult:
    """What one reconcile did; handlers turn it into kopf outcomes and Events."""

    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    problem: Condition | None = None


def _refers_to(raw_tenant: Obj, model_deployment: str) -> bool:
    ref = (raw_tenant.get("spec") or {}).get("modelDeploymentRef") or {}
    return bool(ref.get("name") == model_deployment)


def _is_deleting(obj: Obj) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def _decode(secret: Obj, key: str) -> str | None:
    value = _decode_bytes(secret, key)
    return value.decode() if value is not None else None


async def _resolve_key_hashes(
    client: KubeClient, tenant: Tenant, secrets_by_name: dict[str, Obj], *, generate: bool
) -> tuple[list[str] | None, Condition | None, str]:
    """Hashes of the tenant's valid API keys, a problem, and the Secret's name.

    When the spec references no Secret and the generated one does not exist yet, it is created only with
    ``generate`` (for admitted tenants); otherwise ``(None, None, name)`` says "generate me".
    """
    namespace = str(tenant.metadata["namespace"])
    secret_name, data_key = api_key_secret_ref(tenant)
    secret = secrets_by_name.get(secret_name)
    if secret is None:
        if tenant.spec.api_key_secret_ref is not None:
            return (
                None,
                Condition(
                    "Ready",
                    "False",
                    st.API_KEY_SECRET_NOT_FOUND,
                    f"Secret {secret_name!r} named in spec.apiKeySecretRef does not exist in namespace "
                    f"{namespace!r}; create it with the API key under data key {data_key!r}, or remove "
                    "spec.apiKeySecretRef to have one generated.",
                ),
                secret_name,
            )
        if not generate:
            return None, None, secret_name
        api_key = "kvf-" + secrets.token_urlsafe(32)  # 256 bits of randomness
        try:
            secret = await client.apply(
                kinds.SECRET, build_api_key_secret(tenant, secret_name, api_key), force=False
            )
        except ApiError as exc:
            if not exc.conflict:
                raise
            secret = await client.get(kinds.SECRET, secret_name, namespace)
    current = _decode(secret or {}, data_key)
    if not current:
        return (
            None,
            Condition(
                "Ready",
                "False",
                st.API_KEY_SECRET_NOT_FOUND,
                f"Secret {secret_name!r} has no data key {data_key!r}; put the API key there.",
            ),
            secret_name,
        )
    hashes = [hash_api_key(current)]
    previous = _decode(secret or {}, data_key + PREVIOUS_SUFFIX)
    if previous:
        hashes.append(hash_api_key(previous))
    return hashes, None, secret_name


async def load_salt_master(client: KubeClient, ref: str) -> bytes:
    """The operator's master key from Secret ``namespace/name``; created with 256 random bits if absent.

    Deleting that Secret changes every ModelDeployment's cache salts (a one-off flush of all cached KV).
    """
    namespace, _, name = ref.partition("/")
    data_key = "master-key"
    secret = await client.get(kinds.SECRET, name, namespace)
    if secret is None:
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/name": "kvfleet"},
            },
            "type": "Opaque",
            "data": {data_key: base64.b64encode(secrets.token_bytes(32)).decode()},
        }
        secret = await client.apply(kinds.SECRET, body, force=False)
    value = _decode_bytes(secret, data_key)
    if value is None or len(value) < 32:
        raise ValueError(f"Secret {ref} must hold at least 32 bytes under {data_key!r}")
    return value


def _decode_bytes(secret: Obj, key: str) -> bytes | None:
    data = secret.get("data") or {}
    return base64.b64decode(data[key]) if key in data else None


def _child_kinds(config: OperatorConfig) -> list[kinds.Kind]:
    monitor = {kinds.SERVICE_MONITOR, kinds.POD_MONITOR}
    return [k for k in kinds.CHILD_KINDS if config.monitoring or k not in monitor]


async def _write_status(client: KubeClient, kind: kinds.Kind, raw: Obj, desired: Obj) -> None:
    """Write ``desired`` only if it changes something; an Event when Ready flips or changes reason."""
    if not st.status_changed(raw.get("status"), desired):
        return
    meta = raw["metadata"]
    try:
        await client.apply_status(kind, meta["name"], meta.get("namespace"), desired)
    except ApiError as exc:
        if exc.not_found:  # deleted meanwhile: nothing to report on
            return
        raise
    event = st.compute_ready_event(
        raw, (raw.get("status") or {}).get("conditions"), desired.get("conditions")
    )
    if event is not None:
        await client.create_event(str(meta.get("namespace")), event)


def _problem(reason: str, message: str) -> Condition:
    return Condition("Ready", "False", reason, message)


async def reconcile_model_deployment(
    client: KubeClient, config: OperatorConfig, namespace: str, name: str
) -> ReconcileResult:
    started = time.monotonic()
    outcome = "error"
    try:
        result = await _reconcile(client, config, namespace, name)
        outcome = "invalid" if result.problem else "ok"
        return result
    finally:
        metrics.reconciles.labels("ModelDeployment", outcome).inc()
        metrics.reconcile_duration.labels("ModelDeployment").observe(time.monotonic() - started)


async def _reconcile(
    client: KubeClient, config: OperatorConfig, namespace: str, name: str
) -> ReconcileResult:
    result = ReconcileResult()
    raw_md = await client.get(kinds.MODEL_DEPLOYMENT, name, namespace)
    now = now_rfc3339()
    raw_tenants = [
        t for t in await client.list(kinds.TENANT, namespace) if _refers_to(t, name) and not _is_deleting(t)
    ]
    if raw_md is None or _is_deleting(raw_md):
        await _report_orphans(client, raw_tenants, name, raw_md is not None, now)
        return result
    try:
        md = ModelDeployment.model_validate(raw_md)
    except ValidationError as exc:
        result.problem = _problem(st.INVALID_SPEC, "; ".join(format_validation_error(exc)))
        await _write_md_failure(client, raw_md, result.problem, now)
        return result

    # Tenants: parse, resolve keys, then admit in creation order.
    tenants: list[Tenant] = []
    tenant_problems: dict[str, tuple[Condition, str]] = {}
    key_hashes: dict[str, list[str]] = {}
    to_generate: list[Tenant] = []
    raw_by_name = {str(t["metadata"]["name"]): t for t in raw_tenants}
    # One LIST instead of a GET per tenant: a ModelDeployment may have hundreds of tenants.
    secrets_by_name = (
        {str(s["metadata"]["name"]): s for s in await client.list(kinds.SECRET, namespace)}
        if raw_by_name
        else {}
    )
    for tname, raw in raw_by_name.items():
        try:
            tenant = Tenant.model_validate(raw)
        except ValidationError as exc:
            tenant_problems[tname] = (_problem(st.INVALID_SPEC, "; ".join(format_validation_error(exc))), "")
            continue
        hashes, problem, secret_name = await _resolve_key_hashes(
            client, tenant, secrets_by_name, generate=False
        )
        if problem is not None:
            tenant_problems[tname] = (problem, secret_name)
            continue
        tenants.append(tenant)
        if hashes is None:
            to_generate.append(tenant)
        else:
            key_hashes[tname] = hashes

    try:
        capacity: PoolCapacity | None = compute_pool_capacity(md)
    except SizingError as exc:
        capacity = None
        result.problem = _problem(st.CAPACITY_UNKNOWN, str(exc))
    decisions: list[TenantDecision] = admit_tenants(capacity, tenants) if capacity else []
    # Only admitted tenants get a generated key Secret: a rejected tenant leaves nothing behind.
    admitted_names = {d.name for d in decisions if d.admitted}
    for tenant in to_generate:
        tname = str(tenant.metadata["name"])
        if tname in admitted_names:
            hashes, _problem_unused, _name = await _resolve_key_hashes(
                client, tenant, secrets_by_name, generate=True
            )
            if hashes:
                key_hashes[tname] = hashes

    endpoint = compute_endpoint(md, config.images)
    child_kinds = _child_kinds(config)
    selector = owned_selector(name)
    existing: list[Obj] = []
    for kind in child_kinds:
        existing += await client.list(kind, namespace, label_selector=selector)

    if capacity is not None:
        keys = KeyFile(
            salt_key_hex=config.salt_key_hex(md),
            key_hashes={t: h for t, h in sorted(key_hashes.items()) if t in admitted_names},
        )
        desired = build_desired_children(
            md, capacity, tenants, decisions, keys, config.images, config.monitoring
        )
        for action in compute_plan(desired, existing):
            if action.verb == "apply" and action.obj is not None:
                await client.apply(action.kind, action.obj)
                result.applied.append(action.describe())
            else:
                await client.delete(action.kind, action.name, action.namespace)
                result.deleted.append(action.describe())
        _record_gauges(namespace, name, capacity, tenants, decisions)

    # Status, from the live objects read above (the next reconcile sees the effect of this one's writes).
    live = {(o["kind"], o["metadata"]["name"]): o for o in existing}
    engines = st.readiness_of(
        live.get(("StatefulSet", engine_name(name, SHARED_POOL))), md.spec.pool.replicas
    )
    gateway = st.readiness_of(live.get(("Deployment", gateway_name(name))), md.spec.gateway.replicas)
    md_status = st.compute_model_deployment_status(
        md, capacity, decisions, engines, gateway, endpoint, result.problem, now
    )
    await _write_status(client, kinds.MODEL_DEPLOYMENT, raw_md, md_status)

    by_decision = {d.name: d for d in decisions}
    for tname, raw in raw_by_name.items():
        problem, secret_name = tenant_problems.get(tname, (None, ""))
        parsed = next((t for t in tenants if str(t.metadata["name"]) == tname), None)
        if parsed is None:
            # Unparseable: write conditions only, through a minimal model of its current status.
            await _write_status(client, kinds.TENANT, raw, _bare_failure(raw, problem, now))
            continue
        tenant = parsed
        decision = by_decision.get(tname)
        if problem is None and result.problem is not None:
            problem = Condition("Ready", "Unknown", st.MODEL_DEPLOYMENT_NOT_READY, result.problem.message)
        pool_ready = engines.is_ready and gateway.is_ready
        if decision is not None and decision.pool != SHARED_POOL:
            pool_ready = (
                gateway.is_ready
                and st.readiness_of(
                    live.get(("StatefulSet", engine_name(name, decision.pool))),
                    tenant.spec.dedicated.replicas if tenant.spec.dedicated else 1,
                ).is_ready
            )
        secret_name = secret_name or api_key_secret_ref(tenant)[0]
        tenant_status = st.compute_tenant_status(
            tenant, decision, capacity, problem, pool_ready, endpoint, secret_name, now
        )
        await _write_status(client, kinds.TENANT, raw, tenant_status)
    return result


def _bare_failure(raw: Obj, problem: Condition | None, now: str) -> Obj:
    current = (raw.get("status") or {}).get("conditions") or []
    generation = int(raw["metadata"].get("generation", 0))
    reason, message = (problem.reason, problem.message) if problem else (st.INVALID_SPEC, "Invalid spec.")
    return {
        "conditions": merge_conditions(current, failed(reason, message), generation, now),
        "observedGeneration": generation,
    }


async def _write_md_failure(client: KubeClient, raw_md: Obj, problem: Condition, now: str) -> None:
    await _write_status(client, kinds.MODEL_DEPLOYMENT, raw_md, _bare_failure(raw_md, problem, now))


async def _report_orphans(
    client: KubeClient, raw_tenants: Sequence[Obj], name: str, deleting: bool, now: str
) -> None:
    """Tenants whose ModelDeployment is missing or being deleted get a condition that says so."""
    for raw in raw_tenants:
        if deleting:
            problem = _problem(
                st.MODEL_DEPLOYMENT_DELETING,
                f"ModelDeployment {name!r} is being deleted and waits for this tenant: delete the tenant or "
                "point spec.modelDeploymentRef at another ModelDeployment.",
            )
        else:
            problem = _problem(
                st.MODEL_DEPLOYMENT_NOT_FOUND,
                f"ModelDeployment {name!r} does not exist in this namespace; create it or fix "
                "spec.modelDeploymentRef.name.",
            )
        await _write_status(client, kinds.TENANT, raw, _bare_failure(raw, problem, now))


async def tenants_referencing(client: KubeClient, namespace: str, name: str) -> list[str]:
    return sorted(
        str(t["metadata"]["name"])
        for t in await client.list(kinds.TENANT, namespace)
        if _refers_to(t, name) and not _is_deleting(t)
    )


def _record_gauges(
    namespace: str,
    name: str,
    capacity: PoolCapacity,
    tenants: Sequence[Tenant],
    decisions: Sequence[TenantDecision],
) -> None:
    metrics.pool_capacity_blocks.labels(namespace, name).set(capacity.hbm_blocks)
    metrics.guaranteed_blocks.labels(namespace, name).set(
        sum(d.quota.hbm_blocks for d in decisions if d.admitted and d.quota and d.pool == SHARED_POOL)
    )
    counts: dict[tuple[str, str], int] = {}
    admitted = {d.name for d in decisions if d.admitted}
    for t in tenants:
        if str(t.metadata["name"]) in admitted:
            key = (t.spec.tier.value, t.spec.isolation.value)
            counts[key] = counts.get(key, 0) + 1
    for tier in ("premium", "standard", "basic"):
        for isolation in ("shared", "salted", "dedicated"):
            metrics.tenants.labels(namespace, name, tier, isolation).set(counts.get((tier, isolation), 0))
