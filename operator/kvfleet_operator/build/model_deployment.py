"""Everything one ModelDeployment should own, as data. Pure.

``build_desired_children`` is the whole desired state of a ModelDeployment and its tenants' dedicated
pools. The reconcile shell reads the world, calls it, plans against what exists and applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.api.common import GPU_GROUP_LABEL
from kvfleet_operator.build.common import (
    ENGINE_PORT,
    KEY_FILE_KEY,
    SHARED_POOL,
    TENANT_TABLE_KEY,
    Obj,
    b64,
    config_map_name,
    keys_secret_name,
    metadata,
    object_labels,
    owner_of,
)
from kvfleet_operator.build.engine import (
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
    build_gateway_pdb,
    build_gateway_service,
    gateway_endpoint,
)
from kvfleet_operator.build.gpu_groups import tolerates_gpu_groups
from kvfleet_operator.build.monitoring import build_engine_pod_monitor, build_gateway_service_monitor
from kvfleet_operator.build.network import (
    MetricsScrapers,
    build_engine_network_policy,
    build_gateway_network_policy,
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
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


@dataclass(frozen=True)
class OperatorImages:
    """Default images, set on the operator (Helm values); a ModelDeployment may override them."""

    engine: str
    gateway: str


def _shared_workload(md: ModelDeployment, images: OperatorImages) -> PoolWorkload:
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
        node_selector=node_selector,
        tolerations=tolerations,
        # A wildcard toleration would admit a dedicated group's taint: the shared pool stays off the groups.
        excluded_node_labels=(GPU_GROUP_LABEL,) if tolerates_gpu_groups(tolerations) else (),
        model_volume=ModelVolume(spec.model.source.pvc.claim_name) if spec.model.source.pvc else None,
        nvme=_nvme(md),
    )
    if spec.pool.gpus_per_replica == 0:
        # A CPU engine (demos, tests) runs on an ordinary node; the GPU-node requests (4 CPUs, 32Gi) would
        # leave it unschedulable on a small one.
        return replace(workload, cpu_request="1", memory_request="4Gi")
    return workload


def _nvme(md: ModelDeployment) -> NvmeVolume | None:
    nvme = md.spec.kv_cache.nvme
    if nvme is None:
        return None
    return NvmeVolume(size=nvme.size, storage_class=nvme.storage_class_name, host_path=nvme.host_path)


def _dedicated_workload(
    md: ModelDeployment, tenant: Tenant, pool: str, images: OperatorImages
) -> PoolWorkload:
    shared = _shared_workload(md, images)
    dedicated = tenant.spec.dedicated
    if dedicated is None:  # guarded by the CRD (CEL) and the model validator
        raise ValueError("spec.dedicated is required for isolation: dedicated")
    group = dedicated.gpu_group
    node_selector = {k: v for k, v in shared.node_selector.items() if k != GPU_POOL_LABEL}
    return PoolWorkload(
        namespace=shared.namespace,
        model_deployment=shared.model_deployment,
        pool=pool,
        owner=owner_of(tenant),
        replicas=dedicated.replicas,
        image=shared.image,
        model=shared.model,
        gpus_per_replica=shared.gpus_per_replica,
        node_selector=node_selector,
        # No effect: tolerates the group's NoSchedule and NoExecute taints alike (NoExecute also keeps off
        # a pod created with spec.nodeName, which skips the scheduler).
        tolerations=(*shared.tolerations, {"key": GPU_GROUP_LABEL, "operator": "Equal", "value": group}),
        required_node_labels={GPU_GROUP_LABEL: group},
        model_volume=shared.model_volume,
        nvme=shared.nvme,
    )


def _gateway_workload(md: ModelDeployment, images: OperatorImages) -> GatewayWorkload:
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
    )


def compute_endpoint(md: ModelDeployment, images: OperatorImages) -> str:
    return gateway_endpoint(_gateway_workload(md, images))


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


def build_keys_secret(md: ModelDeployment, keys: KeyFile) -> Obj:
    name = str(md.metadata["name"])
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(
            keys_secret_name(name), str(md.metadata["namespace"]), object_labels(name, "config"), owner_of(md)
        ),
        "type": "Opaque",
        "data": {KEY_FILE_KEY: b64(dump_json(keys))},
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
) -> list[Obj]:
    """All children of ``md``: runtime config, the shared pool, the gateway, and dedicated pools.

    ``monitoring``: the cluster serves monitoring.coreos.com/v1, so add a ServiceMonitor and PodMonitor.
    ``scrapers``: who the NetworkPolicies admit to the metrics ports (default: ``MetricsScrapers()``).
    """
    namespace, name = str(md.metadata["namespace"]), str(md.metadata["name"])
    shared = _shared_workload(md, images)
    workloads = [shared]
    by_name = {str(t.metadata["name"]): t for t in tenants}
    for decision in decisions:
        if decision.admitted and decision.pool != SHARED_POOL:
            workloads.append(_dedicated_workload(md, by_name[decision.name], decision.pool, images))
    endpoints = {w.pool: PoolEndpoints(tuple(replica_endpoints(w, ENGINE_PORT))) for w in workloads}
    table = build_tenant_table(md, capacity, tenants, decisions, endpoints)
    gateway = _gateway_workload(md, images)
    children: list[Obj] = [
        build_config_map(md, table),
        build_keys_secret(md, keys),
        build_gateway_deployment(gateway),
        build_gateway_service(gateway),
        build_gateway_pdb(gateway),
        build_gateway_network_policy(namespace, name, owner_of(md), scrapers),
    ]
    for w in workloads:
        children += [
            build_engine_statefulset(w),
            build_engine_service(w),
            build_engine_pdb(namespace, name, w.pool, w.owner),
            build_engine_network_policy(namespace, name, w.pool, w.owner, scrapers),
        ]
    if monitoring:
        children += [
            build_gateway_service_monitor(gateway),
            build_engine_pod_monitor(namespace, name, owner_of(md)),
        ]
    return children
