"""kopf wiring: every trigger funnels into one coalesced, idempotent reconcile per ModelDeployment.

Triggers:
* an event of a ModelDeployment, or of a child the operator labelled as its own (watched by kopf with a
  server-side label selector, so unrelated Secrets never reach the operator), that changes something a
  reconcile reads: not the operator's own status write, kopf's annotations, nor a child's status beyond
  a pool's ready replicas and a Service's load balancer (``OperatorState.changed``);
* any change of a Tenant but one of its status alone (for the ModelDeployment it references, and the one
  it referenced before when the reference changed), and of a Secret labelled as a tenant's key: seen by
  the watch-fed copies every reconcile reads (``k8s/informer.py``), which replace a LIST of the
  namespace's Tenants and key Secrets per reconcile; the operator's own writes of those are no news;
* a timer per ModelDeployment (``KVFLEET_RESYNC_SECONDS``, default 30 s): the safety net.

Reconciles wait for one of a few slots, a ModelDeployment reconciled before ahead of a first reconcile
(``PrioritySlots``).

Event handlers store nothing on the objects (no progress annotations): the reconcile is level-triggered
and needs no memory. The one finalizer is on ModelDeployments, so that deleting one that tenants still
reference is held back with a condition on those tenants (``ModelDeploymentDeleting``).

All kopf settings live in ``configure`` below. kopf runs only in the replica that holds the Lease
(``handlers/running.py``), which also serves the probes; ``login`` gives kopf's requests that replica's
User-Agent, so the API server's audit log tells replicas apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import kopf
from kopf._cogs.structs.references import Selector  # not re-exported by kopf; documented in its settings

from kvfleet_operator import metrics
from kvfleet_operator.api.common import GROUP, VERSION
from kvfleet_operator.build.common import (
    LABEL_API_KEY,
    LABEL_MANAGED_BY,
    LABEL_MODEL_DEPLOYMENT,
    LABEL_TENANT,
    MANAGED_BY,
)
from kvfleet_operator.build.gateway_store import parse_gateway_store
from kvfleet_operator.build.gpu_groups import parse_gpu_group_owners
from kvfleet_operator.build.guardrails import GUARDRAILS_ENV, parse_guardrails
from kvfleet_operator.build.model_deployment import OperatorImages
from kvfleet_operator.build.network import parse_metrics_scrapers, parse_operator_peer
from kvfleet_operator.handlers.faults import crash_point
from kvfleet_operator.handlers.reconcile import (
    OperatorConfig,
    WatchedReads,
    load_gateway_store,
    load_salt_master,
    reconcile_model_deployment,
    tenants_referencing,
)
from kvfleet_operator.handlers.status_writer import StatusWriter
from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.client import ApiError, Credentials, KubeClient
from kvfleet_operator.k8s.engine_metrics import EngineCapacityReader
from kvfleet_operator.k8s.gateway_store import GatewayStoreProbe
from kvfleet_operator.k8s.informer import Informer
from kvfleet_operator.k8s.leader import default_identity, user_agent
from kvfleet_runtime.config import parse_media_hosts

log = logging.getLogger("kvfleet.operator")

Obj = dict[str, Any]

FINALIZER = "kvfleet.io/finalizer"
ANNOTATION_PREFIX = "kvfleet.io"
RESYNC_SECONDS = float(os.environ.get("KVFLEET_RESYNC_SECONDS", "30"))
#: Seconds a scaled-in pool keeps its leaving replicas after the gateways stopped sending to them
#: (``reconcile/drain.py``; the chart's ``operator.scaleInDrainSeconds``).
DRAIN_SECONDS = float(os.environ.get("KVFLEET_DRAIN_SECONDS", "120"))
#: How long a Tenant status that only says it waits for its pool is held, in case the pool gets ready
#: meanwhile (``handlers/status_writer.py``).
STATUS_HOLD_SECONDS = float(os.environ.get("KVFLEET_STATUS_HOLD_SECONDS", "10"))
#: Reconciles that run at once (of different ModelDeployments; one ModelDeployment's never overlap).
RECONCILES_AT_ONCE = 8
#: Of those, the resync timer's at most (a safety net, not a trigger anyone waits for).
RESYNCS_AT_ONCE = 2
#: How long start-up waits for the first list of Tenants and key Secrets before kopf retries it.
INFORMER_SYNC_SECONDS = 120.0
DEFAULT_ENGINE_IMAGE = "ghcr.io/kvfleet/kvfleet-engine:0.1.0"
DEFAULT_GATEWAY_IMAGE = "ghcr.io/kvfleet/kvfleet:0.1.0"
OWNED = {LABEL_MANAGED_BY: MANAGED_BY}
#: ``namespace/name`` of the operator's master-key Secret (created on first start).
SALT_SECRET = os.environ.get("KVFLEET_SALT_SECRET", "kvfleet-system/kvfleet-salt-master")
OWNED_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
#: Memo key of the namespaces the operator watches (``kvfleet operator --namespace``; empty: all).
MEMO_WATCH_NAMESPACES = "kvfleet_watch_namespaces"
#: Memo key of this replica's identity (its pod's name): its User-Agent carries it, for the audit log.
MEMO_IDENTITY = "kvfleet_identity"
#: JSON ``{"namespaceSelector": ..., "podSelector": ...}``: who may scrape metrics ports (chart value
#: ``metricsScrapers``); unset: ``build.network.MetricsScrapers()``.
METRICS_SCRAPERS_ENV = "KVFLEET_METRICS_SCRAPERS"
#: Hosts whose media URLs the gateways and engines allow (the chart's ``allowedMediaHosts``, comma-separated).
MEDIA_HOSTS_ENV = "KVFLEET_ALLOWED_MEDIA_HOSTS"
#: The gateways' shared store (chart value ``gatewaySharedStore``), JSON (``build/gateway_store.py``).
GATEWAY_STORE_ENV = "KVFLEET_GATEWAY_SHARED_STORE"
#: The operator's own pods as a NetworkPolicy peer (the chart sets it from its release).
OPERATOR_PEER_ENV = "KVFLEET_OPERATOR_PEER"
#: Comma-separated exposure kinds the chart lets the operator manage (``Ingress``, ``HTTPRoute``; chart
#: values ``rbac.ingress``, ``rbac.httpRoute``); unset: none.
EXPOSURE_KINDS_ENV = "KVFLEET_EXPOSURE_KINDS"
#: JSON ``{"<group>": "<namespace>[/<tenant>]"}``: whom the platform bound each dedicated GPU group to
#: (chart value ``dedicatedGpuGroups.owners``); unset: no group is bound.
GPU_GROUP_OWNERS_ENV = "KVFLEET_GPU_GROUP_OWNERS"


class Coalescer:
    """At most one reconcile per key at a time, and at most one queued behind it.

    A trigger that arrives while a run is queued is absorbed by that run: the run reads the world when it
    starts, so it sees whatever the trigger was about.
    """

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._queued: set[tuple[str, str]] = set()

    async def run(self, key: tuple[str, str], fn: Callable[[], Awaitable[None]]) -> bool:
        if key in self._queued:
            return False
        self._queued.add(key)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            self._queued.discard(key)
            await fn()
        return True


class PrioritySlots:
    """At most ``size`` holders at once; when a slot frees, the waiter with the lowest ``priority`` number
    gets it, in arrival order among equals (``asyncio.Semaphore`` is arrival order only)."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._order = itertools.count()
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []

    @contextlib.asynccontextmanager
    async def hold(self, priority: int) -> AsyncIterator[None]:
        if self._free > 0 and not self._waiters:
            self._free -= 1
        else:
            waiter = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (priority, next(self._order), waiter))
            try:
                await waiter
            except asyncio.CancelledError:
                if not waiter.cancelled():  # handed the slot, then cancelled before it ran: pass it on
                    self._release()
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiters:
            _priority, _order, waiter = heapq.heappop(self._waiters)
            if not waiter.done():  # a cancelled waiter stays in the heap until it comes up
                waiter.set_result(None)
                return
        self._free += 1


#: Slot priorities: a ModelDeployment this process has reconciled before goes ahead of one it has not.
KNOWN, NEW = 0, 1


class OperatorState:
    """What handlers share, kept in kopf's memo."""

    def __init__(self, client: KubeClient, config: OperatorConfig) -> None:
        self.client = client
        self.config = config
        self.coalescer = Coalescer()
        #: Reconciles running at once: each holds its ModelDeployment's tenants parsed and their statuses,
        #: so fifty at once would hold every tenant of the cluster several times over. A ModelDeployment
        #: reconciled before goes first: its reconcile is short (its tenants' keys exist, its children
        #: too) and usually tells tenants their pool is ready, while a first one may create hundreds of key
        #: Secrets. Queued behind every first reconcile (ModelDeployments starting together), the
        #: reconcile that sees a pool ready came after the tenants' waiting statuses were written
        #: (``handlers/status_writer.py``: a second status write per tenant for half of 10,000), and a
        #: tenant's edit waited as long.
        self._slots = PrioritySlots(RECONCILES_AT_ONCE)
        self._resync_turns = asyncio.Semaphore(RESYNCS_AT_ONCE)
        #: The ModelDeployments (namespace, name) this process has reconciled at least once.
        self._known: set[tuple[str, str]] = set()
        #: (kind, namespace, name) -> a digest of the object as its watch last showed it, less what no
        #: reconcile reads (:func:`_essence`).
        self._seen: dict[tuple[str, str, str], bytes] = {}
        #: Reconciles started by a watched change (``tenant_changed``), kept until they end.
        self._spawned: set[asyncio.Task[None]] = set()

    async def reconcile(self, namespace: str, name: str, *, resync: bool = False) -> None:
        """One coalesced reconcile. A ``resync`` (the timer's) first waits for one of
        :data:`RESYNCS_AT_ONCE` turns, before it takes the ModelDeployment's lock: fifty timers that fire
        together take a few slots at a time, and a watched change (a tenant's edit) never queues behind
        all of them."""
        if resync:
            async with self._resync_turns:
                await self._coalesced(namespace, name)
        else:
            await self._coalesced(namespace, name)

    async def _coalesced(self, namespace: str, name: str) -> None:
        key = (namespace, name)

        async def _run() -> None:
            async with self._slots.hold(KNOWN if key in self._known else NEW):
                try:
                    result = await reconcile_model_deployment(self.client, self.config, namespace, name)
                finally:
                    self._known.add(key)
            for change in result.applied + result.deleted:
                log.info("%s/%s: %s", namespace, name, change)

        await self.coalescer.run(key, _run)

    def changed(self, event_type: str | None, obj: Obj) -> bool:
        """Whether a watch event of a ModelDeployment or of one of its children is worth a reconcile: not
        when all that changed since the event before is what no reconcile reads (:func:`_essence`): a
        status it wrote itself, kopf's bookkeeping annotations, a child's status beyond its ready replicas
        (a PodDisruptionBudget's counts). While ten thousand tenants start, each of those reconciled
        fifty ModelDeployments again, two hundred tenants each. As for a Tenant, the resync timer restores
        a status that someone else edited."""
        meta = obj.get("metadata") or {}
        key = (str(obj.get("kind") or ""), str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if event_type == "DELETED":
            self._seen.pop(key, None)
            return True
        digest = hashlib.blake2b(json.dumps(_essence(obj), sort_keys=True).encode(), digest_size=16).digest()
        if self._seen.get(key) == digest:
            return False
        self._seen[key] = digest
        return True

    def wrote(self, obj: Obj) -> None:
        """An object the API server answered a write with, for the watch-fed copies."""
        self.config.wrote(obj)

    def tenant_changed(self, old: Obj | None, new: Obj | None) -> None:
        """A Tenant changed (the informer's ``on_change``): reconcile the ModelDeployment it references,
        and the one it referenced before when the reference moved. A change of its status alone (the
        operator's own write) triggers nothing: the status is the reconcile's output, and the resync
        timer restores one that someone else edited."""
        if old is not None and new is not None and _without_status(old) == _without_status(new):
            return
        for namespace, target in {_model_deployment_ref(o) for o in (old, new) if o is not None}:
            if target:
                self._spawn(namespace, target)

    def key_secret_changed(self, old: Obj | None, new: Obj | None) -> None:
        """A Secret labelled as a tenant's key changed (a rotation, a new key): reconcile the ModelDeployment
        of each tenant it is (or was) marked for."""
        for obj in (old, new):
            if obj is None or self.config.reads is None:
                continue
            meta = obj["metadata"]
            owner = (meta.get("labels") or {}).get(LABEL_TENANT)
            tenant = self.config.reads.tenants.get(str(meta.get("namespace")), str(owner)) if owner else None
            if tenant is not None:
                namespace, target = _model_deployment_ref(tenant)
                if target:
                    self._spawn(namespace, target)

    def _spawn(self, namespace: str, name: str) -> None:
        task = asyncio.create_task(self.reconcile(namespace, name), name=f"reconcile-{namespace}/{name}")
        self._spawned.add(task)
        task.add_done_callback(self._reconciled)

    def _reconciled(self, task: asyncio.Task[None]) -> None:
        self._spawned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The resync timer tries again; a watched change must not end the operator.
            log.error("reconcile %s failed: %s", task.get_name(), task.exception())

    async def stop(self) -> None:
        for task in list(self._spawned):
            task.cancel()
        await asyncio.gather(*self._spawned, return_exceptions=True)
        if self.config.status_writer is not None:
            await self.config.status_writer.stop()
        if self.config.reads is not None:
            await self.config.reads.tenants.stop()
            await self.config.reads.key_secrets.stop()


def _without_status(obj: Obj) -> Obj:
    meta = {k: v for k, v in obj["metadata"].items() if k not in ("resourceVersion", "managedFields")}
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": meta}


#: The status fields of a child that a reconcile reads (a pool's readiness, a LoadBalancer's address); a
#: change of any other status field (a PodDisruptionBudget's counts, a rollout's revisions) is no news.
CHILD_STATUS_READ: dict[str, tuple[str, ...]] = {
    "Deployment": ("readyReplicas",),
    "StatefulSet": ("readyReplicas",),
    "Service": ("loadBalancer",),
}


def _essence(obj: Obj) -> Obj:
    """What a watch event must change to be worth a reconcile: ``obj`` without its version and managed
    fields, kopf's annotations (``kvfleet.io/<handler>``, the last handled configuration) and its status,
    but the status fields :data:`CHILD_STATUS_READ` names for its kind."""
    bare = _without_status(obj)
    annotations = bare["metadata"].get("annotations") or {}
    kept = {k: v for k, v in annotations.items() if not k.startswith(f"{ANNOTATION_PREFIX}/")}
    status = obj.get("status") or {}
    read = {k: status[k] for k in CHILD_STATUS_READ.get(str(obj.get("kind")), ()) if k in status}
    return {**bare, "metadata": {**bare["metadata"], "annotations": kept}, "status": read}


def _model_deployment_ref(tenant: Obj) -> tuple[str, str]:
    spec = tenant.get("spec") or {}
    return str(tenant["metadata"].get("namespace") or ""), str(
        (spec.get("modelDeploymentRef") or {}).get("name") or ""
    )


def _state(memo: Any) -> OperatorState:
    state: OperatorState = memo["kvfleet"]
    return state


@kopf.on.startup()
async def configure(*, settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.peering.standalone = True  # one replica, Recreate strategy: no peering objects needed
    # No observation of CRDs and namespaces: the watched namespaces are given by name and the CRDs come
    # with the chart, so the operator needs no cluster-scoped read at all (least privilege).
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.posting.level = logging.WARNING  # Events for what a human should notice, not chatter
    for kind in kinds.CHILD_KINDS:
        group, _sep, version = kind.api_version.rpartition("/")
        selector = Selector(group=group, version=version, plural=kind.plural)
        # Generated API key Secrets are the tenants' (one each): the key Secrets' watch-fed copy sees them,
        # kopf need not (``k8s/informer.py``).
        settings.watching.label_selectors[selector] = (
            f"{OWNED_SELECTOR},!{LABEL_API_KEY}" if kind == kinds.SECRET else OWNED_SELECTOR
        )
    client = KubeClient(
        Credentials.discover(),
        observer=lambda verb: metrics.api_calls.labels(verb).inc(),
        user_agent=user_agent(_identity(memo)),
    )
    await client.__aenter__()
    try:
        try:
            monitoring = await client.api_group_exists("monitoring.coreos.com/v1")
        except ApiError:
            monitoring = False
        config = OperatorConfig(
            salt_master=await load_salt_master(client, SALT_SECRET),
            images=OperatorImages(
                engine=os.environ.get("KVFLEET_ENGINE_IMAGE", DEFAULT_ENGINE_IMAGE),
                gateway=os.environ.get("KVFLEET_GATEWAY_IMAGE", DEFAULT_GATEWAY_IMAGE),
            ),
            monitoring=monitoring,
            watch_namespaces=tuple(memo.get(MEMO_WATCH_NAMESPACES) or ()),
            # A malformed binding stops the start-up: a group must never go to someone nobody named.
            gpu_group_owners=parse_gpu_group_owners(os.environ.get(GPU_GROUP_OWNERS_ENV)),
            # A malformed value stops the start-up with pydantic's message: never a policy nobody asked for.
            metrics_scrapers=parse_metrics_scrapers(os.environ.get(METRICS_SCRAPERS_ENV)),
            # Quotas are admitted against the KV blocks the engines report once they do (their metrics port).
            engine_capacity=EngineCapacityReader(),
            operator_peer=parse_operator_peer(os.environ.get(OPERATOR_PEER_ENV)),
            exposure=kinds.parse_exposure_kinds(os.environ.get(EXPOSURE_KINDS_ENV)),
            # A malformed value stops the start-up too: an allowlist with a typo must not silently allow less
            # or more than the platform meant.
            guardrails=parse_guardrails(os.environ.get(GUARDRAILS_ENV)),
            # As strict: a host name with a typo must not silently allow another host.
            media_hosts=parse_media_hosts(os.environ.get(MEDIA_HOSTS_ENV, "")),
            drain_seconds=DRAIN_SECONDS,
        )
        # A store the gateways could not log in to stops the start-up, naming the Secret.
        store = await load_gateway_store(client, parse_gateway_store(os.environ.get(GATEWAY_STORE_ENV)))
        if store is not None:
            config = dataclasses.replace(
                config, gateway_store=store, gateway_store_probe=GatewayStoreProbe(store)
            )
    except BaseException:
        await client.__aexit__()  # kopf retries start-up: do not leak a session per attempt
        raise
    state = OperatorState(client, config)
    namespaces = config.watch_namespaces or (None,)
    reads = WatchedReads(
        tenants=Informer(client, kinds.TENANT, namespaces, on_change=state.tenant_changed),
        key_secrets=Informer(
            client, kinds.SECRET, namespaces, label_selector=LABEL_TENANT, on_change=state.key_secret_changed
        ),
    )
    writer = StatusWriter(client, state.wrote, reads.tenants.get, hold_seconds=STATUS_HOLD_SECONDS)
    state.config = dataclasses.replace(config, reads=reads, status_writer=writer)
    reads.tenants.start()
    reads.key_secrets.start()
    writer.start()
    try:
        # Every reconcile reads these copies: none may start on half a namespace. kopf runs no handler
        # before its start-up handlers are done.
        await asyncio.wait_for(
            asyncio.gather(reads.tenants.wait_synced(), reads.key_secrets.wait_synced()),
            INFORMER_SYNC_SECONDS,
        )
    except BaseException:
        await state.stop()
        await client.__aexit__()
        raise
    memo["kvfleet"] = state


def _identity(memo: Any) -> str:
    return str(memo.get(MEMO_IDENTITY) or default_identity())


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ConnectionInfo(kopf.ConnectionInfo):
    """kopf's credentials plus a ``User-Agent`` naming this replica (kopf's own is the same for all)."""

    user_agent: str

    def as_http_headers(self) -> dict[str, str]:
        return {**super().as_http_headers(), "User-Agent": self.user_agent}


@kopf.on.login()
def login(*, memo: Any, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's own login (the Kubernetes client's configuration, else the service account, else the
    kubeconfig), with this replica's ``User-Agent`` on kopf's requests."""
    info = (
        kopf.login_via_client(**kwargs)
        or kopf.login_with_service_account(**kwargs)
        or kopf.login_with_kubeconfig(**kwargs)
    )
    if info is None:
        return None
    fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    return _ConnectionInfo(**fields, user_agent=user_agent(_identity(memo), via="kopf/" + kopf_version()))


def kopf_version() -> str:
    from kopf._cogs.helpers import versions  # noqa: PLC0415 - kopf's version is not re-exported

    return str(versions.version or "unknown")


@kopf.on.cleanup()
async def close(*, memo: Any, **_: Any) -> None:
    await _state(memo).stop()
    await _state(memo).client.__aexit__()


@kopf.on.event(group=GROUP, version=VERSION, plural="modeldeployments")
async def on_model_deployment(*, namespace: str | None, name: str, event: Any, memo: Any, **_: Any) -> None:
    state = _state(memo)
    if state.changed(event.get("type"), dict(event.get("object") or {})):
        await state.reconcile(str(namespace), name)


@kopf.timer(group=GROUP, version=VERSION, plural="modeldeployments", interval=RESYNC_SECONDS, sharp=False)
async def resync(*, namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    try:
        await _state(memo).reconcile(str(namespace), name, resync=True)
    except ApiError as exc:
        raise kopf.TemporaryError(f"API error during reconcile: {exc}", delay=5) from exc


def _register_child_watch(kind: kinds.Kind) -> None:
    group, _sep, version = kind.api_version.rpartition("/")

    async def on_child(
        *, namespace: str | None, labels: kopf.Labels, event: Any, memo: Any, **_: Any
    ) -> None:
        owner = labels.get(LABEL_MODEL_DEPLOYMENT)
        state = _state(memo)
        if owner and namespace and state.changed(event.get("type"), dict(event.get("object") or {})):
            await state.reconcile(namespace, owner)

    on_child.__name__ = f"on_{kind.plural}"
    kopf.on.event(group=group, version=version, plural=kind.plural, labels=OWNED, id=f"child-{kind.plural}")(
        on_child
    )


for _kind in kinds.CHILD_KINDS:
    if _kind not in (*kinds.MONITORING_KINDS, *kinds.EXPOSURE_KINDS):  # optional: covered by the timer
        _register_child_watch(_kind)


@kopf.on.delete(group=GROUP, version=VERSION, plural="modeldeployments")
async def on_model_deployment_delete(*, namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """Hold the deletion while tenants reference the ModelDeployment; they get a condition saying so."""
    state = _state(memo)
    remaining = await tenants_referencing(state.client, str(namespace), name)
    if remaining:
        await state.reconcile(str(namespace), name)  # writes ModelDeploymentDeleting on each tenant
        raise kopf.TemporaryError(
            f"{len(remaining)} tenant(s) still reference this ModelDeployment ({', '.join(remaining[:10])}); "
            "delete them or point them elsewhere",
            delay=15,
        )
    crash_point("before-finalizer-removal")
