"""Everything one ModelDeployment should own, as data. Pure.

``build_desired_children`` is the whole desired state of a ModelDeployment and its tenants' dedicated
pools. The reconcile shell reads the world, calls it, plans against what exists and applies.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.api.common import GPU_GROUP_LABEL
from kvfleet_operator.api.modeldeployment import DataPlane, Routing
from kvfleet_operator.api.units import parse_duration, parse_quantity
from kvfleet_operator.build.autoscaling import (
    DedicatedScaling,
    build_dedicated_scaled_object,
    build_scaled_object,
    compute_guarantee_floor,
    shared_replicas,
)
from kvfleet_operator.build.common import (
    ENGINE_PORT,
    KEY_FILE_KEY,
    SHARED_POOL,
    TENANT_TABLE_KEY,
    Obj,
    b64,
    config_map_name,
    engine_name,
    gateway_name,
    keys_secret_name,
    metadata,
    object_labels,
    owner_of,
)
from kvfleet_operator.build.endpoint_picker import (
    build_endpoint_picker,
    build_inference_pool,
    gateway_pods_peer,
    runs_endpoint_picker,
)
from kvfleet_operator.build.engine import (
    ModelFetch,
    ModelVolume,
    NvmeVolume,
    PoolWorkload,
    build_engine_service,
    build_engine_statefulset,
    replica_endpoints,
)
from kvfleet_operator.build.gateway import (
    GatewayWorkload,
    build_engine_pdb,
    build_gateway_deployment,
    build_gateway_exposure,
    build_gateway_metrics_service,
    build_gateway_pdb,
    build_gateway_service,
    gateway_endpoint,
)
from kvfleet_operator.build.gateway_store import GatewayStore, gateway_store_secret_data
from kvfleet_operator.build.gpu_groups import tolerates_gpu_groups
from kvfleet_operator.build.monitoring import (
    build_engine_pod_monitor,
    build_epp_service_monitor,
    build_gateway_service_monitor,
    build_shared_tier_pod_monitor,
)
from kvfleet_operator.build.network import (
    MetricsScrapers,
    OperatorPeer,
    build_engine_network_policy,
    build_epp_network_policy,
    build_gateway_network_policy,
    build_shared_tier_network_policy,
    epp_pods_peer,
)
from kvfleet_operator.build.shared_tier import (
    build_shared_tier_deployment,
    build_shared_tier_service,
    shared_tier_bytes,
)
from kvfleet_operator.build.tenant_table import (
    PoolCapacity,
    PoolEndpoints,
    TenantDecision,
    build_tenant_table,
    model_path,
)
from kvfleet_runtime.config import KeyFile, TenantTable, dump_json

GPU_POOL_LABEL = "kvfleet.io/gpu-pool"
GIB = 1 << 30
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


@dataclass(frozen=True)
class OperatorImages:
    """Default images, set on the operator (Helm values); a ModelDeployment may override them."""

    engine: str
    gateway: str


def shared_workload(md: ModelDeployment, images: OperatorImages) -> PoolWorkload:
    """The shared pool's workload, resolved from ``md`` (dedicated pools derive theirs from it)."""
    spec = md.spec
    meta = md.metadata
    node_selector = dict(spec.pool.node_selector)
    if spec.pool.gpus_per_replica > 0:
        node_selector.setdefault(GPU_POOL_LABEL, SHARED_POOL)
        if spec.pool.gpu_type:
            node_selector.setdefault(GPU_PRODUCT_LABEL, spec.pool.gpu_type)
    tolerations = tuple(
        t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in spec.pool.tolerations
    )
    workload = PoolWorkload(
        namespace=str(meta["namespace"]),
        model_deployment=str(meta["name"]),
        pool=SHARED_POOL,
        owner=owner_of(md),
        replicas=spec.pool.replicas,
        image=spec.engine.image or images.engine,
        model=model_path(md),
        gpus_per_replica=spec.pool.gpus_per_replica,
        gpu_resource=spec.pool.gpu_resource,
        node_selector=node_selector,
        tolerations=tolerations,
        # A wildcard toleration would admit a dedicated group's taint: the shared pool stays off the groups.
        excluded_node_labels=(GPU_GROUP_LABEL,) if tolerates_gpu_groups(tolerations) else (),
        model_volume=ModelVolume(spec.model.source.pvc.claim_name) if spec.model.source.pvc else None,
        model_fetch=ModelFetch(spec.model.source.cache_claim_name)
        if spec.model.source.hugging_face
        else None,
        credentials_secret=(
            spec.model.source.credentials_secret_ref.name
            if spec.model.source.credentials_secret_ref
            else None
        ),
        nvme=_nvme(md),
        tier_memory_bytes=compute_tier_memory_bytes(md),
        cpu_kv_cache_gib=cpu_kv_cache_gib(md),
        template=spec.pool.pod_template,
    )
    if spec.pool.gpus_per_replica == 0:
        # A CPU engine (demos, tests) runs on an ordinary node; the GPU-node requests (4 CPUs, 32Gi) would
        # leave it unschedulable on a small one.
        return replace(workload, cpu_request="1", memory_request="4Gi")
    return workload


def cpu_kv_cache_gib(md: ModelDeployment) -> int | None:
    """``spec.pool.cpuKvCacheSpace`` in GiB, as vLLM's CPU build reads ``VLLM_CPU_KVCACHE_SPACE`` (an
    integer; the API takes whole GiB only)."""
    space = md.spec.pool.cpu_kv_cache_space
    return None if space is None else parse_quantity(space) // GIB


def compute_tier_memory_bytes(md: ModelDeployment) -> int:
    """Host memory a replica holds besides the engine's own: the LMCache CPU tier and a CPU engine's KV
    cache. The engine's memory request carries it, so the scheduler places a 256Gi CPU tier only where it
    fits. (LMCache's small L1 floor for an NVMe-only pool fits in the engine's own request.)"""
    space = md.spec.pool.cpu_kv_cache_space
    return parse_quantity(md.spec.kv_cache.cpu_size) + (parse_quantity(space) if space is not None else 0)


def _nvme(md: ModelDeployment) -> NvmeVolume | None:
    nvme = md.spec.kv_cache.nvme
    if nvme is None:
        return None
    return NvmeVolume(size=nvme.size, storage_class=nvme.storage_class_name, host_path=nvme.host_path)


def _dedicated_workload(
    md: ModelDeployment, tenant: Tenant, pool: str, images: OperatorImages
) -> PoolWorkload:
    shared = shared_workload(md, images)
    dedicated = tenant.spec.dedicated
    if dedicated is None:  # guarded by the CRD (CEL) and the model validator
        raise ValueError("spec.dedicated is required for isolation: dedicated")
    group = dedicated.gpu_group
    node_selector = {k: v for k, v in shared.node_selector.items() if k != GPU_POOL_LABEL}
    # Everything else (image, model, GPUs, template, requests) is the shared pool's: same engine shape.
    return replace(
        shared,
        pool=pool,
        owner=owner_of(tenant),
        replicas=dedicated.replicas,
        node_selector=node_selector,
        # No effect: tolerates the group's NoSchedule and NoExecute taints alike (NoExecute also keeps off
        # a pod created with spec.nodeName, which skips the scheduler).
        tolerations=(*shared.tolerations, {"key": GPU_GROUP_LABEL, "operator": "Equal", "value": group}),
        required_node_labels={GPU_GROUP_LABEL: group},
        excluded_node_labels=(),
    )


def _dedicated_pool(
    md: ModelDeployment,
    tenant: Tenant,
    pool: str,
    images: OperatorImages,
    bounds: DedicatedScaling | None,
) -> tuple[PoolWorkload, Obj | None]:
    """A dedicated pool's workload, and its ScaledObject when it autoscales: then it runs no more replicas
    than ``bounds`` allow (maxReplicas within what its GPU group holds; unclamped without ``bounds``)."""
    workload = _dedicated_workload(md, tenant, pool, images)
    dedicated = tenant.spec.dedicated
    if dedicated is None or not dedicated.autoscaling.enabled:
        return workload, None
    auto = dedicated.autoscaling
    bounds = bounds or DedicatedScaling(auto.min_replicas, auto.max_replicas, None)
    workload = replace(workload, replicas=bounds.replicas(workload.replicas))
    return workload, build_dedicated_scaled_object(md, tenant, pool, owner_of(tenant), bounds)


def dedicated_pod_spec(md: ModelDeployment, tenant: Tenant, pool: str, images: OperatorImages) -> Obj:
    """The pod spec of ``tenant``'s dedicated ``pool`` as its StatefulSet runs it: what a GPU group's
    capacity is counted for (``reconcile/group_capacity.py``)."""
    pod: Obj = build_engine_statefulset(_dedicated_workload(md, tenant, pool, images))["spec"]["template"]
    return dict(pod["spec"])


def _gateway_workload(
    md: ModelDeployment, images: OperatorImages, inference_pool_served: bool = True
) -> GatewayWorkload:
    """``inference_pool_served``: the operator may apply InferencePools and the cluster serves them; when
    not, ``spec.gateway.inferencePool`` has no effect beyond the condition that says why."""
    spec = md.spec.gateway
    requests = spec.resources.requests
    limits = spec.resources.limits
    return GatewayWorkload(
        namespace=str(md.metadata["namespace"]),
        model_deployment=str(md.metadata["name"]),
        owner=owner_of(md),
        replicas=spec.replicas,
        image=spec.image or images.gateway,
        cpu_request=(requests.cpu if requests and requests.cpu else "500m"),
        memory_request=(requests.memory if requests and requests.memory else "256Mi"),
        memory_limit=(limits.memory if limits and limits.memory else "1Gi"),
        exposure=spec.exposure,
        fair_queuing=spec.fair_queuing,
        engine_in_flight_per_replica=spec.engine_in_flight_per_replica,
        queue_timeout_s=None if spec.queue_timeout is None else parse_duration(spec.queue_timeout),
        data_plane=spec.data_plane,
        inference_pool=spec.inference_pool if inference_pool_served else None,
        epp_tls_secret=spec.endpoint_picker.tls_secret_name,
        precise_routing=spec.routing is Routing.PRECISE,
    )


def compute_endpoint(
    md: ModelDeployment, images: OperatorImages, children: Sequence[Obj] = (), withheld: Collection[str] = ()
) -> str:
    """``status.endpoint``: see ``build.gateway.gateway_endpoint``; ``children`` as listed (the client
    Service's live status has a LoadBalancer's address), ``withheld`` the exposure kinds not created."""
    name = gateway_name(str(md.metadata["name"]))
    service = next(
        (o for o in children if o.get("kind") == "Service" and o["metadata"]["name"] == name), None
    )
    return gateway_endpoint(_gateway_workload(md, images), service, withheld)


def build_config_map(md: ModelDeployment, table: TenantTable) -> Obj:
    name = str(md.metadata["name"])
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(
            config_map_name(name), str(md.metadata["namespace"]), object_labels(name, "config"), owner_of(md)
        ),
        "data": {TENANT_TABLE_KEY: dump_json(table)},
    }


def build_keys_secret(md: ModelDeployment, keys: KeyFile, store: GatewayStore | None = None) -> Obj:
    name = str(md.metadata["name"])
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(
            keys_secret_name(name), str(md.metadata["namespace"]), object_labels(name, "config"), owner_of(md)
        ),
        "type": "Opaque",
        "data": {KEY_FILE_KEY: b64(dump_json(keys)), **gateway_store_secret_data(store)},
    }


def build_desired_children(
    md: ModelDeployment,
    capacity: PoolCapacity,
    tenants: Sequence[Tenant],
    decisions: Sequence[TenantDecision],
    keys: KeyFile,
    images: OperatorImages,
    monitoring: bool = False,
    scrapers: MetricsScrapers | None = None,
    operator: OperatorPeer | None = None,
    media_hosts: tuple[str, ...] = (),
    inference_pool_served: bool = True,
    gateway_store: GatewayStore | None = None,
    draining: Mapping[str, tuple[int, str]] | None = None,
    dedicated_scaling: Mapping[str, DedicatedScaling] | None = None,
) -> list[Obj]:
    """All children of ``md``: runtime config, the shared pool, the gateway, dedicated pools, and the
    shared pool's KV tier across replicas when ``spec.kvCache.shared`` enables it.

    ``monitoring``: the cluster serves monitoring.coreos.com/v1, so add a ServiceMonitor and PodMonitor.
    ``scrapers``: who the NetworkPolicies admit to the metrics ports (default: ``MetricsScrapers()``);
    ``operator``: the operator's pods, admitted to the engines' metrics port to read their KV capacity.
    ``media_hosts``: the hosts whose media URLs the gateway lets through and the engines fetch from (the
    chart's ``allowedMediaHosts``; empty: only ``data:`` URLs).
    ``gateway_store``: the store the gateway replicas split rate limits through (``build.gateway_store``).
    ``draining``: engine StatefulSet name -> the replicas it keeps running and its ``kvfleet.io/drain``
    annotation while its pool drains replicas away (``reconcile/drain.py``); the tenant table lists only
    the replicas that stay.
    ``dedicated_scaling``: tenant -> the bounds of its autoscaled dedicated pool within its GPU group
    (``reconcile/group_capacity.py``): its StatefulSet runs no more than the group holds, and its
    ScaledObject's maximum is clamped alike (a tenant missing there autoscales unclamped).
    ``inference_pool_served``: the operator may manage InferencePools and the cluster serves their API.
    With ``spec.gateway.inferencePool`` the InferencePools are built either way (the reconcile withholds
    them and says why, ``reconcile.steps.withhold_exposure``), but only when served does anything route to
    them or admit the platform gateway's pods; the Endpoint Picker runs for either.
    """
    namespace, name = str(md.metadata["namespace"]), str(md.metadata["name"])
    floor = compute_guarantee_floor(md, tenants, decisions)
    # Never below the guarantee floor while autoscaling owns spec.pool.replicas (build/autoscaling.py).
    shared = replace(shared_workload(md, images), replicas=shared_replicas(md, floor))
    workloads = [shared]
    by_name = {str(t.metadata["name"]): t for t in tenants}
    dedicated_scaled: list[Obj] = []
    for decision in decisions:
        if decision.admitted and decision.pool != SHARED_POOL:
            tenant = by_name[decision.name]
            bounds = (dedicated_scaling or {}).get(decision.name)
            workload, scaled_object = _dedicated_pool(md, tenant, decision.pool, images, bounds)
            workloads.append(workload)
            dedicated_scaled += [scaled_object] if scaled_object is not None else []
    if media_hosts:
        workloads = [replace(w, allowed_media_domains=media_hosts) for w in workloads]
    endpoints = {w.pool: PoolEndpoints(tuple(replica_endpoints(w, ENGINE_PORT))) for w in workloads}
    table = build_tenant_table(md, capacity, tenants, decisions, endpoints)
    gateway = replace(
        _gateway_workload(md, images, inference_pool_served),
        allowed_media_domains=media_hosts,
        shared_store=gateway_store,
    )
    envoy = gateway.data_plane is DataPlane.ENVOY
    # The platform gateway's pods, admitted to the engines and the EPP only while InferencePools are served.
    peers = (
        [gateway_pods_peer(gateway.inference_pool.gateway_pods, namespace)] if gateway.inference_pool else []
    )
    children: list[Obj] = [
        build_config_map(md, table),
        build_keys_secret(md, keys, gateway_store),
        build_gateway_deployment(gateway),
        build_gateway_service(gateway),
        # Envoy serves no metrics: the EPP's are the gateway's (build_epp_service_monitor).
        *([] if envoy else [build_gateway_metrics_service(gateway)]),
        build_gateway_pdb(gateway),
        build_gateway_network_policy(namespace, name, owner_of(md), scrapers),
        *build_gateway_exposure(gateway),
    ]
    runs_epp = runs_endpoint_picker(md)
    # Who calls the engines' OpenAI port besides the gateway: the picker (its health checks) and the
    # platform gateway.
    engine_callers = [*([epp_pods_peer(name)] if runs_epp else []), *peers]
    if runs_epp:
        children += build_endpoint_picker(gateway)
        children.append(
            build_epp_network_policy(
                namespace, name, owner_of(md), scrapers, own_gateway=envoy, gateway_peers=peers
            )
        )
    for w in workloads:
        running, drain = (draining or {}).get(engine_name(w.model_deployment, w.pool), (None, None))
        children += [
            build_engine_statefulset(replace(w, running_replicas=running, drain=drain)),
            build_engine_service(w),
            build_engine_pdb(namespace, name, w.pool, w.owner),
            build_engine_network_policy(namespace, name, w.pool, w.owner, scrapers, operator, engine_callers),
        ]
        if md.spec.gateway.inference_pool is not None:
            children.append(build_inference_pool(namespace, name, w.pool, w.owner))
    if size := shared_tier_bytes(md):
        children += [
            build_shared_tier_deployment(
                namespace, name, owner_of(md), md.spec.engine.image or images.engine, size
            ),
            build_shared_tier_service(namespace, name, owner_of(md)),
            build_shared_tier_network_policy(namespace, name, owner_of(md), scrapers),
        ]
        if monitoring:
            children.append(build_shared_tier_pod_monitor(namespace, name, owner_of(md)))
    if monitoring:
        children += [
            *([] if envoy else [build_gateway_service_monitor(gateway)]),
            *([build_epp_service_monitor(gateway)] if runs_epp else []),
            build_engine_pod_monitor(namespace, name, owner_of(md)),
        ]
    # KEDA's ScaledObject for the shared pool (withheld, with a condition, where the chart grants no
    # rights on it or the cluster runs no KEDA: reconcile.steps.withhold_exposure).
    scaled = build_scaled_object(namespace, name, md.spec.pool.autoscaling, owner_of(md), floor)
    if scaled is not None:
        children.append(scaled)
    # The autoscaled dedicated pools' ScaledObjects, owned by their Tenants (build/autoscaling.py).
    return children + dedicated_scaled
