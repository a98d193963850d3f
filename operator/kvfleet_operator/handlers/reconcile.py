"""One idempotent reconcile of a ModelDeployment and all its Tenants, as a list of named steps.

Every kopf handler (create, update, resume, timer, child events, tenant events) ends up in
:func:`reconcile_model_deployment`. It is level-triggered: it looks only at the current state of the
world, never at what changed. A converged ModelDeployment costs reads only; the counter on
``KubeClient`` proves it in tests.

The reconcile runs :data:`STEPS` in order over one :class:`Cycle` (what this reconcile read and
decided so far). Each step is small and named for what it does; the steps that touch no API call pure
functions of ``reconcile/`` and ``build/``, tested without a cluster. A step that finds nothing left to
do (the ModelDeployment is missing, being deleted or does not parse) ends the work; the status steps
(:data:`STATUS_STEPS`) always run: status is computed as new objects from what the cycle saw, and written
only where it differs from the status read.

Partial state is impossible by construction: a tenant that cannot be admitted (quota, missing Secret,
invalid spec) is left out of the desired state entirely, so nothing of it is applied, and it gets a
condition that says why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from kvfleet_operator import metrics
from kvfleet_operator.api import ModelDeployment, Tenant, reasons
from kvfleet_operator.api.common import GPU_GROUP_LABEL
from kvfleet_operator.api.units import parse_duration
from kvfleet_operator.build.autoscaling import DedicatedScaling, admit_seats
from kvfleet_operator.build.common import (
    LABEL_TENANT,
    SHARED_POOL,
    engine_name,
    owned_selector,
    selector_labels,
)
from kvfleet_operator.build.gateway_store import GatewayStore, GatewayStoreRef, read_secret_key
from kvfleet_operator.build.gpu_groups import (
    GroupBinding,
    decide_gpu_group_claims,
    gpu_group_claims,
)
from kvfleet_operator.build.guardrails import Guardrails, check_model_deployment, describe_refusals
from kvfleet_operator.build.keys import (
    KeyResolution,
    build_api_key_secret,
    build_key_file,
    build_salt_master_secret,
    derive_salt_key_hex,
    new_api_key,
    new_master_key,
    read_salt_master,
    resolve_api_key_hashes,
)
from kvfleet_operator.build.model_deployment import (
    OperatorImages,
    build_desired_children,
    compute_endpoint,
    dedicated_pod_spec,
)
from kvfleet_operator.build.network import MetricsScrapers, OperatorPeer
from kvfleet_operator.build.tenant_table import (
    PoolCapacity,
    TenantDecision,
    admit_tenants,
    dedicated_pool_name,
)
from kvfleet_operator.handlers.faults import crash_point
from kvfleet_operator.handlers.status_writer import StatusWriter
from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.client import ApiError, KubeClient
from kvfleet_operator.k8s.engine_metrics import EngineCapacityReader
from kvfleet_operator.k8s.gateway_store import GatewayStoreProbe
from kvfleet_operator.k8s.informer import Informer
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile import steps
from kvfleet_operator.reconcile.capacity import (
    EngineCapacity,
    decide_engine_capacity,
    effective_capacity,
    engine_metrics_targets,
    explain_capacity_below_plan,
    owned_engine_pods,
)
from kvfleet_operator.reconcile.conditions import DEGRADED, ConditionUpdate, now_rfc3339
from kvfleet_operator.reconcile.drain import compute_drains, drain_annotation, serving_ready_replicas
from kvfleet_operator.reconcile.group_capacity import plan_dedicated_scaling, replicas_by_tenant
from kvfleet_operator.reconcile.node_loss import (
    ENGINE_POD_REPLACED,
    ENGINE_POD_STUCK_ON_LOST_NODE,
    Verdict,
    decide_lost_engine_pods,
    node_loss_event,
)
from kvfleet_operator.reconcile.ownership import (
    NameCollision,
    controlled_by,
    find_collision,
    name_in_use_problem,
    owned_children,
    split_collisions,
)
from kvfleet_operator.reconcile.plan import Action, compute_plan

log = logging.getLogger(__name__)

#: Generated key Secrets created at once by one reconcile.
KEY_CREATES_AT_ONCE = 16

Obj = dict[str, Any]


@dataclass(frozen=True)
class WatchedReads:
    """Watch-fed copies of what every reconcile reads (``k8s/informer.py``): the watched namespaces'
    Tenants, and their Secrets labelled ``kvfleet.io/tenant`` (the only Secrets the operator reads).
    The operator's own writes of those go into the copies as the API server answered them."""

    tenants: Informer
    key_secrets: Informer

    async def list_tenants(self, namespace: str | None) -> list[Obj]:
        return self.tenants.list(namespace)

    async def list_key_secrets(self, namespace: str) -> list[Obj]:
        return self.key_secrets.list(namespace)


@dataclass(frozen=True)
class OperatorConfig:
    images: OperatorImages
    #: The operator's master key (from its own Secret); each ModelDeployment's salt key derives from it
    #: (``build/keys.py``), so a deleted or edited keys Secret is restored with the same salts.
    salt_master: bytes
    #: Whether the cluster serves monitoring.coreos.com/v1 (checked once at start-up).
    monitoring: bool = False
    #: The namespaces the operator watches; empty: all. Dedicated GPU groups are owned across them.
    watch_namespaces: tuple[str, ...] = ()
    #: Whom the platform bound each dedicated GPU group to (chart value ``dedicatedGpuGroups.owners``,
    #: ``KVFLEET_GPU_GROUP_OWNERS``; ``build/gpu_groups.py``). A group missing here serves no new pool.
    gpu_group_owners: Mapping[str, GroupBinding] = field(default_factory=dict)
    #: Who the NetworkPolicies admit to the metrics ports (chart value ``metricsScrapers``).
    metrics_scrapers: MetricsScrapers = field(default_factory=MetricsScrapers)
    #: The exposure kinds (Ingress, HTTPRoute, InferencePool) the chart lets the operator manage
    #: (``rbac.ingress``, ``rbac.httpRoute``, ``rbac.inferencePool``; ``KVFLEET_EXPOSURE_KINDS``): only
    #: these are listed, created and pruned.
    exposure: tuple[kinds.Kind, ...] = ()
    #: Reads the KV blocks each ready engine pod allocated (``k8s/engine_metrics.py``); ``None``: quotas
    #: are admitted against the planner's estimate only (an operator that cannot reach the pod network).
    engine_capacity: EngineCapacityReader | None = None
    #: The operator's own pods, which the engine NetworkPolicies admit to the metrics port
    #: (``KVFLEET_OPERATOR_PEER``); ``None`` when it runs outside the cluster.
    operator_peer: OperatorPeer | None = None
    #: What the platform lets a ModelDeployment ask for (chart value ``guardrails``,
    #: ``KVFLEET_GUARDRAILS``; ``build/guardrails.py``). The default allows only the operator's images,
    #: no host path, tuning flags, ClusterIP and Gateways in the ModelDeployment's own namespace.
    guardrails: Guardrails = field(default_factory=Guardrails)
    #: Hosts whose http(s) media URLs the gateways let through and the engines fetch from (chart value
    #: ``allowedMediaHosts``, ``KVFLEET_ALLOWED_MEDIA_HOSTS``); empty: only ``data:`` URLs.
    media_hosts: tuple[str, ...] = ()
    #: The store the gateway replicas split rate limits through (chart value ``gatewaySharedStore``,
    #: ``KVFLEET_GATEWAY_SHARED_STORE``; ``build/gateway_store.py``); ``None``: 1/replicas each.
    gateway_store: GatewayStore | None = None
    #: Asks that store whether it serves (``k8s/gateway_store.py``), for ``SharedStoreUnreachable``.
    gateway_store_probe: GatewayStoreProbe | None = None
    #: Seconds a scaled-in pool keeps its leaving replicas after the gateways stopped sending to them
    #: (``reconcile/drain.py``; ``KVFLEET_DRAIN_SECONDS``); 0: they go at once.
    drain_seconds: float = 0.0
    #: Where Tenants and key Secrets are read: the operator's watch-fed copies; ``None``: a LIST per
    #: reconcile (a reconcile run on its own, as the tests and tools do).
    reads: WatchedReads | None = None
    #: Who writes the Tenants' statuses (``handlers/status_writer.py``: newest only, a few at once);
    #: ``None``: the reconcile writes them itself before it returns (tests, tools).
    status_writer: StatusWriter | None = None

    async def list_tenants(self, client: KubeClient, namespace: str | None) -> list[Obj]:
        if self.reads is not None:
            return await self.reads.list_tenants(namespace)
        return await client.list(kinds.TENANT, namespace)

    async def list_key_secrets(self, client: KubeClient, namespace: str) -> list[Obj]:
        if self.reads is not None:
            return await self.reads.list_key_secrets(namespace)
        return await client.list(kinds.SECRET, namespace, label_selector=LABEL_TENANT)

    def wrote(self, obj: Obj) -> None:
        """An object the API server answered a write with, for the copies (a Tenant or a key Secret)."""
        if self.reads is None:
            return
        if obj.get("kind") == kinds.TENANT.kind:
            self.reads.tenants.observe(obj)
        elif obj.get("kind") == kinds.SECRET.kind and LABEL_TENANT in (obj["metadata"].get("labels") or {}):
            self.reads.key_secrets.observe(obj)


@dataclass
class ReconcileResult:
    """What one reconcile did; handlers turn it into kopf outcomes and Events."""

    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    #: Why the ModelDeployment cannot be served (invalid spec, pool cannot be sized); ``None`` if it can.
    problem: ConditionUpdate | None = None


@dataclass
class Cycle:
    """One reconcile of one ModelDeployment: each step reads what the steps before it filled in and adds
    its part."""

    config: OperatorConfig
    namespace: str
    name: str
    now: str
    result: ReconcileResult = field(default_factory=ReconcileResult)
    #: Set by a step that leaves the remaining work steps nothing to do; the status steps still run.
    finished: bool = False
    #: The spec asks for what the platform does not allow (``check_guardrails``): nothing is written.
    refused: bool = False
    raw_md: Obj | None = None
    #: The ModelDeployment's tenants as read (not being deleted), by name, in the order listed.
    raw_tenants: dict[str, Obj] = field(default_factory=dict)
    #: The uids of every Tenant of the namespace: with the ModelDeployment's, the owners whose children
    #: the reconcile may update or prune (``reconcile/ownership.py``).
    tenant_uids: set[str] = field(default_factory=set)
    secrets: dict[str, Obj] = field(default_factory=dict)
    md: ModelDeployment | None = None
    #: Tenants that parse and whose API key resolves (or will be generated once admitted).
    tenants: list[Tenant] = field(default_factory=list)
    #: Tenants that parse but whose API key is refused: not served, but an admitted one keeps its room.
    key_refused: list[Tenant] = field(default_factory=list)
    #: Why a tenant is left out before admission (invalid spec, missing API key Secret).
    tenant_problems: dict[str, ConditionUpdate] = field(default_factory=dict)
    #: What degrades a tenant that is still served (``Degraded``: its GPU group is not bound yet).
    tenant_warnings: dict[str, ConditionUpdate] = field(default_factory=dict)
    keys: dict[str, KeyResolution] = field(default_factory=dict)
    #: The figure quotas are admitted against: the engines' own once one reported (``read_engine_capacity``).
    capacity: PoolCapacity | None = None
    #: The planner's estimate (``size_pool``), kept for the status and the ``CapacityBelowPlan`` message.
    planned: PoolCapacity | None = None
    engine: EngineCapacity | None = None
    decisions: list[TenantDecision] = field(default_factory=list)
    #: The ModelDeployment's engine pods, once a step listed them (``None``: not listed).
    engine_pods: list[Obj] | None = None
    #: The children this ModelDeployment owns, as listed (live status included).
    children: list[Obj] = field(default_factory=list)
    #: The cluster's nodes, read only while engines wait (``None``: not read, or no right to list them).
    nodes: list[Obj] | None = None
    #: Tenant -> the bounds of its autoscaled dedicated pool within its GPU group (``bound_dedicated_pools``).
    dedicated_scaling: dict[str, DedicatedScaling] = field(default_factory=dict)
    desired: list[Obj] | None = None
    #: Exposure kinds the operator may manage but the cluster does not serve (their list answered 404).
    unserved: set[kinds.Kind] = field(default_factory=set)
    #: Exposure kind name -> why the object the spec asks for is not created (``ExposureUnavailable``).
    withheld: dict[str, str] = field(default_factory=dict)
    plan: list[Action] = field(default_factory=list)
    status_writes: list[st.StatusWrite] = field(default_factory=list)
    #: Why the gateways' shared store does not serve (``check_gateway_store``); ``None``: it does, or none.
    store_note: str | None = None


Step = Callable[[KubeClient, Cycle], Awaitable[None]]


# --- Steps, in the order they run. -----------------------------------------------------------------


async def read_model_deployment(client: KubeClient, c: Cycle) -> None:
    c.raw_md = await client.get(kinds.MODEL_DEPLOYMENT, c.name, c.namespace)


async def read_tenants(client: KubeClient, c: Cycle) -> None:
    listed = await c.config.list_tenants(client, c.namespace)
    c.tenant_uids = {str(t["metadata"].get("uid") or "") for t in listed} - {""}
    c.raw_tenants = steps.select_tenants(listed, c.name)


async def parse_model_deployment(client: KubeClient, c: Cycle) -> None:
    """Missing or being deleted: its tenants say so (status steps). Invalid: it says why."""
    if c.raw_md is None or steps.is_deleting(c.raw_md):
        c.finished = True
        return
    parsed = steps.parse_model_deployment(c.raw_md)
    if isinstance(parsed, ConditionUpdate):
        c.result.problem = parsed
        c.finished = True
        return
    c.md = parsed


async def check_guardrails(client: KubeClient, c: Cycle) -> None:
    """A spec the platform does not allow (``build/guardrails.py``) gets ``GuardrailRefused`` naming each
    field, and nothing is written for it: no child created, changed or deleted, no key generated. The rest
    of the cycle still reads and decides, so the status (tenants' admitted quotas included) stays whole,
    and pods an older operator started keep running until the spec is fixed."""
    if c.md is None:
        return
    managed = {kind.kind for kind in c.config.exposure}
    refusals = check_model_deployment(c.md, c.config.guardrails, c.config.images, managed)
    if refusals:
        c.refused = True
        c.result.problem = st.problem(reasons.GUARDRAIL_REFUSED, describe_refusals(refusals))


async def read_secrets(client: KubeClient, c: Cycle) -> None:
    """The namespace's key Secrets: only those labelled ``kvfleet.io/tenant`` (a server-side selector, so
    the operator never reads another Secret's data; RBAC cannot say so, the selector does). One LIST
    instead of a GET per tenant: a ModelDeployment may have hundreds of tenants."""
    if c.raw_tenants:
        listed = await c.config.list_key_secrets(client, c.namespace)
        c.secrets = {str(s["metadata"]["name"]): s for s in listed}


async def parse_tenants(client: KubeClient, c: Cycle) -> None:
    c.tenants, problems = steps.parse_tenants(c.raw_tenants)
    c.tenant_problems |= problems


async def claim_gpu_groups(client: KubeClient, c: Cycle) -> None:
    """A dedicated GPU group serves the Tenant the platform bound it to (``build/gpu_groups.py``): any other
    claimant is left out, with ``GpuGroupInUse`` naming the binding, or ``GpuGroupNotBound`` naming the
    chart value to set. On a group nobody bound yet (an upgrade), the pool that already runs keeps running,
    ``Degraded``."""
    if not any(t.spec.dedicated for t in c.tenants):
        return  # only a ModelDeployment with a dedicated tenant needs the cluster-wide view
    listed: list[Obj] = []
    for namespace in c.config.watch_namespaces or (None,):
        listed += await c.config.list_tenants(client, namespace)
    bindings = c.config.gpu_group_owners
    running: list[str] = []
    for t in c.tenants:  # only on an unbound group (an upgrade): does its pool run already?
        if t.spec.dedicated is None or t.spec.dedicated.gpu_group in bindings:
            continue
        name = str(t.metadata["name"])
        pool = await client.get(
            kinds.STATEFUL_SET, engine_name(c.name, dedicated_pool_name(name)), c.namespace
        )
        if pool is not None and controlled_by(pool, str(t.metadata.get("uid") or "")):
            running.append(name)
    decided = decide_gpu_group_claims(
        c.tenants, gpu_group_claims([*listed, *c.raw_tenants.values()]), bindings, running
    )
    c.tenants = [t for t in c.tenants if str(t.metadata["name"]) not in decided.refused]
    c.tenant_problems |= {name: st.problem(*why) for name, why in decided.refused.items()}
    c.tenant_warnings |= {
        name: ConditionUpdate(DEGRADED, "True", reasons.GPU_GROUP_NOT_BOUND, why)
        for name, why in decided.unbound.items()
    }


async def resolve_keys(client: KubeClient, c: Cycle) -> None:
    """Missing, unmarked, weak or shared keys leave their tenants out (``build/keys.py``)."""
    resolved = steps.resolve_keys(c.tenants, c.secrets, c.name)
    c.tenants, c.key_refused, c.keys = resolved.usable, resolved.refused, resolved.resolutions
    c.tenant_problems |= resolved.problems


async def size_pool(client: KubeClient, c: Cycle) -> None:
    if c.md is None:  # unreachable: parse_model_deployment finishes the cycle without a model
        return
    sized = steps.size_pool(c.md)
    if isinstance(sized, ConditionUpdate):
        c.result.problem = c.result.problem or sized
    else:
        c.capacity = c.planned = sized


async def read_engine_capacity(client: KubeClient, c: Cycle) -> None:
    """The KV blocks vLLM really allocated, from the ready engine pods' metrics ports (one LIST of the
    engine pods; each pod's figure is read once in its life, see ``reconcile/capacity.py``). Admission then
    counts on the fewest any replica holds; before any engine reports, on the planner's estimate."""
    if c.md is None or c.planned is None:
        return
    reported: list[int] = []
    if c.config.engine_capacity is not None:
        selector = ",".join(f"{k}={v}" for k, v in selector_labels(c.name, "engine").items())
        try:
            pods = await client.list(kinds.POD, c.namespace, label_selector=selector)
        except ApiError as exc:
            if exc.status != 403:  # forbidden (RBAC granted by hand without pods): the estimate stands
                raise
            pods = []
        c.engine_pods = pods
        # Only the pods the ModelDeployment's own StatefulSets control count, by UID: a pod that merely
        # wears the engine labels says nothing about the pool (``reconcile/capacity.owned_engine_pods``).
        pools = await client.list(kinds.STATEFUL_SET, c.namespace, label_selector=owned_selector(c.name))
        md_uid = str((c.raw_md or {}).get("metadata", {}).get("uid", ""))
        targets = engine_metrics_targets(pods, pools, md_uid)
        reported = list((await c.config.engine_capacity.read(targets)).values())
    previous = c.md.status.kv_capacity if c.md.status is not None else None
    c.engine = decide_engine_capacity(c.planned.hbm_blocks, reported, previous)
    c.capacity = effective_capacity(c.planned, c.engine)


async def admit(client: KubeClient, c: Cycle) -> None:
    """Sticky, then first come, first served (``build/tenant_table.py``); no capacity, no admission. On an
    autoscaled pool a new guaranteed-tier tenant also needs seats on ready replicas, or waits for them
    (``build/autoscaling.admit_seats``; the live StatefulSet is among the children read before)."""
    if c.capacity is None or c.md is None:
        return
    decisions = admit_tenants(c.capacity, c.tenants, held=c.key_refused)
    shared = engine_name(c.name, SHARED_POOL)
    engines = st.live_child(c.children, "StatefulSet", shared)
    c.decisions = admit_seats(c.md, c.tenants, decisions, serving_ready_replicas(engines))


async def generate_api_keys(client: KubeClient, c: Cycle) -> None:
    """A generated key Secret for each admitted tenant that has none; created once, never overwritten.
    The first alone, the others :data:`KEY_CREATES_AT_ONCE` at a time (a pool starting with hundreds of
    tenants would otherwise wait for hundreds of round trips one after another)."""
    if c.refused:
        return
    by_name = {str(t.metadata["name"]): t for t in c.tenants}
    names = steps.keys_to_generate(c.keys, c.decisions)
    slots = asyncio.Semaphore(KEY_CREATES_AT_ONCE)

    async def generate(name: str) -> None:
        tenant = by_name[name]
        body = build_api_key_secret(tenant, c.keys[name].secret_name, new_api_key())
        async with slots:
            try:
                # Create, never apply: a Secret of that name that exists already (unlabelled, so not
                # listed) is someone's, and is read below, never written (``reconcile/ownership.py``).
                secret: Obj | None = await client.create(kinds.SECRET, body)
                c.config.wrote(secret or {})
            except ApiError as exc:
                if not exc.conflict:
                    raise
                secret = await client.get(kinds.SECRET, c.keys[name].secret_name, c.namespace)
        resolution = c.keys[name] = resolve_api_key_hashes(tenant, secret or {})
        if resolution.reason is not None:  # a Secret of that name existed, and may not be its key
            c.tenant_problems[name] = st.problem(resolution.reason, resolution.message or "")
            c.tenants.remove(tenant)
            c.key_refused.append(tenant)
            c.decisions = [d for d in c.decisions if d.name != name]

    if names:
        await generate(names[0])
    if len(names) > 1:
        crash_point("between-key-secrets")
        await asyncio.gather(*(generate(name) for name in names[1:]))


async def read_children(client: KubeClient, c: Cycle) -> None:
    """Every owned child: listed by label, kept only when the ModelDeployment or one of the namespace's
    Tenants controls it (a label is not ownership: anything else wearing it is neither updated nor
    pruned). An exposure kind whose API the cluster does not serve (an HTTPRoute without the Gateway API
    CRDs: 404) has no children and is recorded, so the reconcile says so instead of failing."""
    selector = owned_selector(c.name)
    listed: list[Obj] = []
    for kind in steps.child_kinds(c.config.monitoring, c.config.exposure):
        try:
            listed += await client.list(kind, c.namespace, label_selector=selector)
        except ApiError as exc:
            if not (exc.not_found and kind in kinds.EXPOSURE_KINDS):
                raise
            c.unserved.add(kind)
    owners = {str((c.raw_md or {}).get("metadata", {}).get("uid") or ""), *c.tenant_uids} - {""}
    c.children += owned_children(listed, owners)


async def bound_dedicated_pools(client: KubeClient, c: Cycle) -> None:
    """Autoscaled dedicated pools scale within their GPU group's nodes (``reconcile/group_capacity.py``):
    one LIST of those groups' nodes (by label), only when an admitted dedicated tenant autoscales, gives each
    pool its bounds for its StatefulSet and ScaledObject, and its tenant a ``Degraded`` note where
    autoscaling does not work as asked. Without the right to list nodes (the chart's ``rbac.readNodes``)
    the pools autoscale unclamped and say so (``GroupCapacityUnknown``)."""
    if c.md is None or c.refused:
        return
    pools = {d.name: d.pool for d in c.decisions if d.admitted and d.pool != SHARED_POOL}
    scaled = [
        (t, dedicated_pod_spec(c.md, t, pools[str(t.metadata["name"])], c.config.images))
        for t in c.tenants
        if str(t.metadata["name"]) in pools and t.spec.dedicated and t.spec.dedicated.autoscaling.enabled
    ]
    if not scaled:
        return
    groups = ",".join(sorted({t.spec.dedicated.gpu_group for t, _ in scaled if t.spec.dedicated}))
    nodes: list[Obj] | None
    try:
        nodes = await client.list(kinds.NODE, label_selector=f"{GPU_GROUP_LABEL} in ({groups})")
    except ApiError as exc:
        if exc.status != 403:  # forbidden: rbac.readNodes is off
            raise
        nodes = None
    c.dedicated_scaling, notes = plan_dedicated_scaling(
        c.md,
        scaled,
        nodes,
        managed=kinds.SCALED_OBJECT in c.config.exposure,
        served=kinds.SCALED_OBJECT not in c.unserved,
    )
    for name, note in notes.items():
        c.tenant_warnings.setdefault(name, note)  # a group not bound yet says more


async def build_desired(client: KubeClient, c: Cycle) -> None:
    """Without capacity, or for a spec the guardrails refuse, nothing is desired, and nothing is planned:
    existing children are left alone."""
    if c.md is None or c.capacity is None or c.refused:
        return
    admitted = {d.name for d in c.decisions if d.admitted}
    keys = build_key_file(derive_salt_key_hex(c.config.salt_master, c.md), steps.key_hashes(c.keys), admitted)

    def build(draining: Mapping[str, tuple[int, str]] | None = None) -> list[Obj]:
        assert c.md is not None and c.capacity is not None
        return build_desired_children(
            c.md,
            c.capacity,
            c.tenants,
            c.decisions,
            keys,
            c.config.images,
            c.config.monitoring,
            c.config.metrics_scrapers,
            c.config.operator_peer,
            c.config.media_hosts,
            gateway_store=c.config.gateway_store,
            inference_pool_served=kinds.INFERENCE_POOL in c.config.exposure
            and kinds.INFERENCE_POOL not in c.unserved,
            draining=draining,
            dedicated_scaling=c.dedicated_scaling,
        )

    desired = build()
    # A pool scaled in keeps its leaving replicas until the gateways have stopped sending to them for the
    # drain grace (reconcile/drain.py): the table lists the replicas that stay, the StatefulSet runs all.
    if drains := compute_drains(desired, c.children, c.now, c.config.drain_seconds):
        desired = build({name: (d.running, drain_annotation(d)) for name, d in drains.items()})
    # An Ingress, HTTPRoute or InferencePool the operator may not manage or the cluster does not serve is
    # left out (and said so on the status), never a failed apply that would stop the rest of the reconcile.
    c.desired, c.withheld = steps.withhold_exposure(desired, c.config.exposure, c.unserved)


async def read_nodes(client: KubeClient, c: Cycle) -> None:
    """The nodes, while some engine pool waits for replicas: to say why when none can run its pods
    (``NoMatchingNodes``, ``reconcile/placement.py``). Needs the chart's node-reading ClusterRole
    (``rbac.readNodes``); without it the check is skipped."""
    if not steps.engines_waiting(c.desired, c.children):
        return
    try:
        c.nodes = await client.list(kinds.NODE)
    except ApiError as exc:
        if exc.status != 403:  # forbidden: rbac.readNodes is off; the pods' own events still tell
            raise


async def plan(client: KubeClient, c: Cycle) -> None:
    if c.desired is not None:
        c.plan = compute_plan(c.desired, c.children)


async def _collisions(
    client: KubeClient, c: Cycle, seen: dict[tuple[str, str], Obj | None]
) -> list[NameCollision]:
    """The planned applies whose name is in use by an object their owner does not control. A listed
    child was read already; any other name costs one GET (``seen`` keeps them across rounds), so a
    converged ModelDeployment costs none."""
    live = {(o["kind"], o["metadata"]["name"]): o for o in c.children}
    found: list[NameCollision] = []
    for action in c.plan:
        if action.verb != "apply" or action.obj is None:
            continue
        key = (action.kind.kind, action.name)
        if key not in live and key not in seen:
            seen[key] = await client.get(action.kind, action.name, action.namespace)
        collision = find_collision(action.obj, live.get(key) or seen.get(key))
        if collision is not None:
            found.append(collision)
    return found


async def claim_names(client: KubeClient, c: Cycle) -> None:
    """Write nothing over an object the owner does not control (``reconcile/ownership.py``). A dedicated
    tenant whose pool's name is in use is left out (``NameInUse`` on it) and the rest is built again
    without it; a name in use by any other child stops every write of this reconcile (``NameInUse`` on
    the ModelDeployment): nothing is half-applied."""
    seen: dict[tuple[str, str], Obj | None] = {}
    while c.plan:
        collisions = await _collisions(client, c, seen)
        if not collisions:
            return
        pools = {d.pool: d.name for d in c.decisions if d.pool != SHARED_POOL}
        by_tenant, own = split_collisions(collisions, pools)
        if own:
            c.result.problem = name_in_use_problem(collisions, "ModelDeployment")
            c.plan, c.desired = [], None
            return
        for name, theirs in by_tenant.items():
            c.tenant_problems[name] = name_in_use_problem(theirs, "Tenant")
        c.tenants = [t for t in c.tenants if str(t.metadata["name"]) not in by_tenant]
        c.decisions = [d for d in c.decisions if d.name not in by_tenant]
        await build_desired(client, c)
        await plan(client, c)


async def apply(client: KubeClient, c: Cycle) -> None:
    """Server-side apply of what is missing or differs, in dependency order."""
    for action in c.plan:
        if action.verb == "apply" and action.obj is not None:
            await client.apply(action.kind, action.obj)
            c.result.applied.append(action.describe())


async def prune(client: KubeClient, c: Cycle) -> None:
    """Delete owned children no longer desired, after the applies, in reverse dependency order."""
    for action in c.plan:
        if action.verb == "delete":
            await client.delete(action.kind, action.name, action.namespace)
            c.result.deleted.append(action.describe())


#: Uids of held lost pods (``Verdict.HOLD``) this operator process already told about: one Event each, not
#: one per resync. A restarted operator tells once more.
_held_reported: set[str] = set()


async def replace_lost_engine_pods(client: KubeClient, c: Cycle) -> None:
    """Force-delete engine pods evicted from a lost node once ``spec.pool.nodeLoss`` allows it
    (``reconcile/node_loss.py``), so their StatefulSet starts the replacements; an Event and a log line
    each. Only while some engine StatefulSet lacks ready replicas (a lost pod is not ready): a healthy pool
    costs no pod list. Nothing else changes while a lost pod waits, so the resync timer re-checks."""
    if c.md is None or not steps.engines_waiting(c.desired, c.children):
        return
    if c.engine_pods is None:
        selector = ",".join(f"{k}={v}" for k, v in selector_labels(c.name, "engine").items())
        try:
            c.engine_pods = await client.list(kinds.POD, c.namespace, label_selector=selector)
        except ApiError as exc:
            if exc.status != 403:  # forbidden (RBAC granted by hand without pods): nothing to decide on
                raise
            return
    node_loss = c.md.spec.pool.node_loss
    nvme = c.md.spec.kv_cache.nvme
    node_ready = None if c.nodes is None else {str(n["metadata"]["name"]): _node_ready(n) for n in c.nodes}
    # Only the pods the ModelDeployment's StatefulSets control, by UID: a pod that wears the engine labels
    # is not force-deleted for it (``reconcile/capacity.owned_engine_pods``).
    pools = [o for o in c.children if o.get("kind") == "StatefulSet"]
    md_uid = str((c.raw_md or {}).get("metadata", {}).get("uid", ""))
    lost = decide_lost_engine_pods(
        owned_engine_pods(c.engine_pods, pools, md_uid),
        datetime.now(UTC),
        node_loss.replace,
        parse_duration(node_loss.after),
        volume_bound=nvme is not None and nvme.storage_class_name is not None,
        node_ready=node_ready,
    )
    for pod in lost:
        if pod.verdict is Verdict.WAIT:
            log.info("%s/%s: %s", c.namespace, c.name, pod.message)
            continue
        if pod.verdict is Verdict.HOLD:
            if pod.uid not in _held_reported:
                _held_reported.add(pod.uid)
                log.warning("%s/%s: %s", c.namespace, c.name, pod.message)
                await client.create_event(
                    c.namespace, node_loss_event(c.raw_md or {}, ENGINE_POD_STUCK_ON_LOST_NODE, pod, c.now)
                )
            continue
        if await client.force_delete(kinds.POD, pod.name, c.namespace, pod.uid):
            log.warning("%s/%s: %s", c.namespace, c.name, pod.message)
            c.result.deleted.append(f"Pod/{pod.name} (lost node {pod.node})")
            await client.create_event(
                c.namespace, node_loss_event(c.raw_md or {}, ENGINE_POD_REPLACED, pod, c.now)
            )


def _node_ready(node: Obj) -> str:
    conditions = (node.get("status") or {}).get("conditions") or []
    return next((str(x.get("status")) for x in conditions if x.get("type") == "Ready"), "Unknown")


async def record_gauges(client: KubeClient, c: Cycle) -> None:
    if c.capacity is not None:
        _record_gauges(c.namespace, c.name, c.capacity, c.tenants, c.decisions)


async def compute_status(client: KubeClient, c: Cycle) -> None:
    """New status objects from what this cycle read and decided (the objects as read stay untouched)."""
    if c.md is None or c.raw_md is None:
        c.status_writes = st.compute_unserved_statuses(
            c.name, c.raw_md, list(c.raw_tenants.values()), c.result.problem, c.now
        )
        return
    c.status_writes = st.compute_served_statuses(
        c.raw_md,
        c.md,
        c.capacity,
        c.decisions,
        c.result.problem,
        compute_endpoint(c.md, c.config.images, c.children, c.withheld),
        c.children,
        c.raw_tenants,
        c.tenants,
        c.tenant_problems,
        c.now,
        c.keys,
        steps.compute_placement(c.desired, c.nodes, c.decisions),
        " ".join(v for k, v in c.withheld.items() if k != kinds.SCALED_OBJECT.kind) or None,
        c.engine,
        _capacity_note(c),
        c.tenant_warnings,
        c.store_note,
        # A dedicated pool's ScaledObject withheld is its Tenant's news (bound_dedicated_pools).
        c.withheld.get(kinds.SCALED_OBJECT.kind) if c.md.spec.pool.autoscaling.enabled else None,
        replicas_by_tenant(c.tenants, c.dedicated_scaling),
    )


async def check_gateway_store(client: KubeClient, c: Cycle) -> None:
    """Whether the gateways' shared store answers (asked at most every few seconds for all
    ModelDeployments: ``GatewayStoreProbe``), for the ``SharedStoreUnreachable`` condition."""
    if c.config.gateway_store_probe is not None and c.md is not None:
        c.store_note = await c.config.gateway_store_probe.problem()


async def write_status(client: KubeClient, c: Cycle) -> None:
    """Only statuses that change something; an Event when Ready flips or changes reason, or when the
    object becomes degraded for another reason (``status.compute_events``). A tenant's Events of its pool
    (it became Ready, it waits for the ModelDeployment) are told in one Event per kind on the
    ModelDeployment (``status.compute_tenant_summary_events``). With a ``status_writer`` (the operator),
    the tenants' statuses go to it; the ModelDeployment's is written here."""
    told: list[Obj] = []
    writer = c.config.status_writer
    for write in c.status_writes:
        if writer is not None and write.kind == kinds.TENANT:
            writer.submit(write, c.raw_md)  # unchanged too: it cancels an older status that waits
        elif write.changed:
            told += await _write_status(client, c.config, write, summarized=c.raw_md is not None)
    if told and c.raw_md is not None:
        for event in st.compute_tenant_summary_events(c.raw_md, told, c.now):
            await client.create_event(c.namespace, event)


#: The work, in order. A step that sets ``Cycle.finished`` ends it.
STEPS: Final[tuple[Step, ...]] = (
    read_model_deployment,
    read_tenants,
    parse_model_deployment,
    check_guardrails,
    read_secrets,
    parse_tenants,
    claim_gpu_groups,
    resolve_keys,
    size_pool,
    read_engine_capacity,
    read_children,
    admit,
    generate_api_keys,
    bound_dedicated_pools,
    build_desired,
    read_nodes,
    plan,
    claim_names,
    apply,
    prune,
    replace_lost_engine_pods,
    record_gauges,
    check_gateway_store,
)
#: Always run after the work, however it ended.
STATUS_STEPS: Final[tuple[Step, ...]] = (compute_status, write_status)


# --- The shell around the steps. --------------------------------------------------------------------


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
    cycle = Cycle(config=config, namespace=namespace, name=name, now=now_rfc3339())
    for step in STEPS:
        await step(client, cycle)
        if cycle.finished:
            break
    if cycle.result.applied or cycle.result.deleted:
        crash_point("after-children-before-status")
    for step in STATUS_STEPS:
        await step(client, cycle)
    return cycle.result


async def _write_status(
    client: KubeClient, config: OperatorConfig, write: st.StatusWrite, *, summarized: bool
) -> list[Obj]:
    """Write one status and its Events; with ``summarized``, a Tenant's Events of its pool are returned
    instead, for the ModelDeployment's summary (``status.told_on_model_deployment``)."""
    meta = write.raw["metadata"]
    try:
        config.wrote(await client.apply_status(write.kind, meta["name"], meta.get("namespace"), write.status))
    except ApiError as exc:
        if exc.not_found:  # deleted meanwhile: nothing to report on
            return []
        raise
    told: list[Obj] = []
    for event in st.compute_events(
        write.raw, (write.raw.get("status") or {}).get("conditions"), write.status.get("conditions")
    ):
        if summarized and write.kind == kinds.TENANT and st.told_on_model_deployment(event):
            told.append(event)
        else:
            await client.create_event(str(meta.get("namespace")), event)
    return told


async def load_salt_master(client: KubeClient, ref: str) -> bytes:
    """The operator's master key from Secret ``namespace/name``; created with 256 random bits if absent.

    Deleting that Secret changes every ModelDeployment's cache salts (a one-off flush of all cached KV).
    """
    namespace, _, name = ref.partition("/")
    secret = await client.get(kinds.SECRET, name, namespace)
    if secret is None:
        secret = await client.apply(
            kinds.SECRET, build_salt_master_secret(namespace, name, new_master_key()), force=False
        )
    return read_salt_master(secret, ref)


async def load_gateway_store(client: KubeClient, ref: GatewayStoreRef | None) -> GatewayStore | None:
    """The gateways' shared store with its password and CA read from the release namespace's Secrets
    (``build/gateway_store.py``); ``ValueError`` naming what is missing stops the start-up: gateways must
    never be rendered with a store they cannot log in to."""
    if ref is None:
        return None
    password = ca_pem = None
    if ref.password_secret is not None:
        secret = await client.get(kinds.SECRET, ref.password_secret.name, ref.namespace)
        password = read_secret_key(
            secret, ref.password_secret, ref.namespace, "gatewaySharedStore.passwordSecret"
        ).strip()
    if ref.ca_secret is not None:
        secret = await client.get(kinds.SECRET, ref.ca_secret.name, ref.namespace)
        ca_pem = read_secret_key(secret, ref.ca_secret, ref.namespace, "gatewaySharedStore.caSecret")
    return GatewayStore(ref.url, password, ca_pem)


async def tenants_referencing(client: KubeClient, namespace: str, name: str) -> list[str]:
    return sorted(steps.select_tenants(await client.list(kinds.TENANT, namespace), name))


def _capacity_note(c: Cycle) -> str | None:
    if c.md is None or c.planned is None or c.engine is None:
        return None
    shared = [d for d in c.decisions if d.admitted and d.quota is not None and d.pool == SHARED_POOL]
    rejected = sum(1 for d in c.decisions if d.reason == reasons.QUOTA_EXCEEDS_CAPACITY)
    guaranteed = sum(d.quota.hbm_blocks for d in shared if d.quota is not None)
    return explain_capacity_below_plan(c.md, c.planned, c.engine, guaranteed, rejected)


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
