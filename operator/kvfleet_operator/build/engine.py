"""Engine pool workloads: a StatefulSet of vLLM + LMCache pods and its headless Service. Pure.

Each replica is a pod whose one container runs ``kvfleet engine launch`` (the engine image): it builds
vLLM's and LMCache's command lines from the pool's settings in the tenant table (so the operator and the
local demo start them the same way) and supervises, in one process group:

* the LMCache server (CPU tier L1, NVMe tier L2 on the replica's volume, ``IsolatedLRU`` on L2), its ZMQ
  and HTTP ports (quotas, cache clear) bound to the pod's loopback;
* vLLM's OpenAI server on ``http``, for the gateway, with the tenant-aware block-pool plugin enabled;
* the quota sync, which keeps LMCache's per-tenant quotas in step with the table (its metrics on loopback).

The pod's one port for Prometheus is ``metrics`` (the plugin's server): it re-exports vLLM's, LMCache's and
the sync's series with the plugin's own and serves no inference API (``build/network.py`` admits scrapers
there only, and the gateway only on ``http``).

A StatefulSet (not a Deployment) gives replicas stable DNS names, which the gateway's prefix affinity
hashes onto, and one NVMe volume per replica. Those volumes are deleted with the StatefulSet (so with the
ModelDeployment, or with the Tenant that owns a dedicated pool): cached KV never outlives its pool. A
host-path NVMe tier cannot be cleaned that way; each replica writes under its own
``<hostPath>/<namespace>/<pod>`` so that pools and replicas sharing a node never share files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_operator.build.common import (
    CONFIG_DIR,
    ENGINE_METRICS_PORT_NAME,
    ENGINE_PORT,
    KEY_FILE_KEY,
    KEYS_DIR,
    LMCACHE_HTTP_PORT,
    LMCACHE_PORT,
    LMCACHE_SYNC_METRICS_PORT,
    MODEL_MOUNT,
    NVME_MOUNT,
    PLUGIN_METRICS_PORT,
    TENANT_TABLE_KEY,
    Obj,
    Owner,
    config_map_name,
    engine_name,
    keys_secret_name,
    metadata,
    object_labels,
    restricted_container_security,
    restricted_pod_security,
    selector_labels,
)

#: The pod name, from the downward API (the NVMe folder on a host path is named after it).
POD_NAME_ENV = "KVFLEET_POD_NAME"


@dataclass(frozen=True)
class NvmeVolume:
    """The per-replica L2 tier: a PVC per replica from a storage class, or a host path."""

    size: str
    storage_class: str | None = None
    host_path: str | None = None


@dataclass(frozen=True)
class ModelVolume:
    """Weights from a PVC, mounted read-only at ``/models``."""

    claim_name: str


@dataclass(frozen=True)
class PoolWorkload:
    """Everything the engine builders need for one pool, already resolved from the CRs."""

    namespace: str
    model_deployment: str
    pool: str
    owner: Owner
    replicas: int
    image: str
    #: What vLLM loads (a path under /models for PVC sources, else a Hugging Face id or URI).
    model: str
    gpus_per_replica: int
    gpu_resource: str = "nvidia.com/gpu"
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[Obj, ...] = ()
    #: Labels a node must carry (dedicated GPU groups): a required node affinity, not a preference.
    required_node_labels: dict[str, str] = field(default_factory=dict)
    #: Label keys a node must not carry (a shared pool whose tolerations would admit a dedicated group's
    #: taint): a required node affinity ``DoesNotExist``.
    excluded_node_labels: tuple[str, ...] = ()
    model_volume: ModelVolume | None = None
    nvme: NvmeVolume | None = None
    shm_size: str = "8Gi"
    cpu_request: str = "4"
    memory_request: str = "32Gi"


def _config_args(pool: str) -> list[str]:
    return [
        "--config",
        f"{CONFIG_DIR}/{TENANT_TABLE_KEY}",
        "--keys",
        f"{KEYS_DIR}/{KEY_FILE_KEY}",
        "--pool",
        pool,
    ]


def _config_mounts() -> list[Obj]:
    return [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},  # an emptyDir: the root filesystem is read-only
    ]


def _affinity(w: PoolWorkload) -> Obj | None:
    if not w.required_node_labels and not w.excluded_node_labels:
        return None
    expressions: list[Obj] = [
        {"key": key, "operator": "In", "values": [value]}
        for key, value in sorted(w.required_node_labels.items())
    ]
    expressions += [{"key": key, "operator": "DoesNotExist"} for key in sorted(w.excluded_node_labels)]
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": expressions}]
            }
        }
    }


def _nvme_dir(w: PoolWorkload) -> str:
    """The replica's NVMe folder. On a host path, ``<namespace>/<pod>`` below it (the container expands
    ``$(KVFLEET_POD_NAME)``): two pools or two replicas on one node never share LMCache's files."""
    if w.nvme is not None and w.nvme.host_path is not None:
        return f"{NVME_MOUNT}/{w.namespace}/$({POD_NAME_ENV})"
    return NVME_MOUNT


def build_engine_statefulset(w: PoolWorkload) -> Obj:
    name = engine_name(w.model_deployment, w.pool)
    labels = object_labels(w.model_deployment, "engine", w.pool)
    selector = selector_labels(w.model_deployment, "engine", w.pool)
    gpu = str(w.gpus_per_replica)
    engine: Obj = {
        "name": "engine",
        "image": w.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "kvfleet",
            "engine",
            "launch",
            *_config_args(w.pool),
            "--model",
            w.model,
            # vLLM's bind address (the gateway dials the pod IP); LMCache, the sync's metrics and the
            # plugin's debug endpoint bind loopback whatever it says (the launcher).
            "--host",
            "0.0.0.0",
            "--port",
            str(ENGINE_PORT),
            "--lmcache-port",
            str(LMCACHE_PORT),
            "--lmcache-http-port",
            str(LMCACHE_HTTP_PORT),
            "--metrics-port",
            str(LMCACHE_SYNC_METRICS_PORT),
            "--plugin-metrics-port",
            str(PLUGIN_METRICS_PORT),
            "--state-dir",
            "/tmp/kvfleet",
            *(["--nvme-dir", _nvme_dir(w)] if w.nvme is not None else []),
        ],
        "env": [
            {"name": "HOME", "value": "/tmp"},
            {"name": "VLLM_PLUGINS", "value": "kvfleet"},
            {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [
            {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
            {"name": ENGINE_METRICS_PORT_NAME, "containerPort": PLUGIN_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": {
            "requests": {"cpu": w.cpu_request, "memory": w.memory_request, w.gpu_resource: gpu},
            "limits": {w.gpu_resource: gpu},
        },
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 180,  # large models take up to 30 minutes to load
        },
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
        "securityContext": restricted_container_security(),
        "volumeMounts": [*_config_mounts(), {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": config_map_name(w.model_deployment)}},
        {"name": "keys", "secret": {"secretName": keys_secret_name(w.model_deployment)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": w.shm_size}},
    ]
    if w.model_volume is not None:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": w.model_volume.claim_name, "readOnly": True},
            }
        )
        engine["volumeMounts"].append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    claim_templates: list[Obj] = []
    if w.nvme is not None:
        engine["volumeMounts"].append({"name": "nvme", "mountPath": NVME_MOUNT})
        if w.nvme.host_path is not None:
            # Directory, not DirectoryOrCreate: a folder the kubelet creates is root's, and the engine runs
            # as uid 10001. The platform team provides it, writable; LMCache creates the replica's folder.
            volumes.append({"name": "nvme", "hostPath": {"path": w.nvme.host_path, "type": "Directory"}})
        else:
            pvc_spec: Obj = {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": w.nvme.size}},
            }
            if w.nvme.storage_class is not None:
                pvc_spec["storageClassName"] = w.nvme.storage_class
            claim_templates.append({"metadata": {"name": "nvme"}, "spec": pvc_spec})

    pod_spec: Obj = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": restricted_pod_security(),
        "terminationGracePeriodSeconds": 60,
        "containers": [engine],
        "volumes": volumes,
    }
    if w.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(w.node_selector.items()))
    if w.tolerations:
        pod_spec["tolerations"] = list(w.tolerations)
    affinity = _affinity(w)
    if affinity is not None:
        pod_spec["affinity"] = affinity
    spec: Obj = {
        "replicas": w.replicas,
        "serviceName": name,
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector},
        "template": {"metadata": {"labels": labels}, "spec": pod_spec},
    }
    if claim_templates:
        spec["volumeClaimTemplates"] = claim_templates
        # The replicas' NVMe volumes (cached KV) go with the StatefulSet. A replica scaled away keeps its
        # volume until the pool goes (Retain): deleting it would block a quick scale back up while the
        # claim terminates (seen when drift repair restores replicas), and it holds only this pool's KV.
        spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(name, w.namespace, labels, w.owner),
        "spec": spec,
    }


def build_engine_service(w: PoolWorkload) -> Obj:
    """Headless: the gateway addresses each replica by its stable DNS name."""
    name = engine_name(w.model_deployment, w.pool)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(name, w.namespace, object_labels(w.model_deployment, "engine", w.pool), w.owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector_labels(w.model_deployment, "engine", w.pool),
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": ENGINE_METRICS_PORT_NAME,
                    "port": PLUGIN_METRICS_PORT,
                    "targetPort": ENGINE_METRICS_PORT_NAME,
                    "protocol": "TCP",
                },
            ],
        },
    }


def replica_endpoints(w: PoolWorkload, port: int) -> list[str]:
    """Base URLs of each replica through the headless Service (``<pod>.<svc>.<ns>.svc``)."""
    name = engine_name(w.model_deployment, w.pool)
    return [f"http://{name}-{i}.{name}.{w.namespace}.svc:{port}" for i in range(w.replicas)]
