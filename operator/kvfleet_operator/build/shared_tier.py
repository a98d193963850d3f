"""The shared pool's KV tier across replicas (``spec.kvCache.shared``): its server, Service, and how each
replica's LMCache reaches it. Pure.

One Deployment (one replica, ``Recreate``: the tier is a cache, and two servers behind one Service would
split it) runs ``kvfleet engine shared-tier`` from the engine image with the tenant table and key file
mounted like an engine pod's: it serves the shared pool's salts only, with their CPU-tier quotas and
TTLs (``kvfleet_runtime.engine.shared_tier``). Its memory request and limit are the tier's size plus
``SHARED_TIER_OVERHEAD`` for the process. A ClusterIP Service gives it a stable name; every replica of the
shared pool gets that name as the ``resp`` L2 adapter of its LMCache (``LMCacheSettings.shared_host``).
Dedicated pools never get it: their tenants share nothing with anyone.

The pod runs under the ``restricted`` Pod Security level with a read-only root filesystem; its NetworkPolicy
(``network.build_shared_tier_network_policy``) admits the shared pool's engine pods on the KV port and
the metrics scrapers on the metrics port, nothing else.
"""

from __future__ import annotations

from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.api.units import parse_quantity
from kvfleet_operator.build.common import (
    CONFIG_DIR,
    KEY_FILE_KEY,
    KEYS_DIR,
    SHARED_POOL,
    SHARED_TIER_COMPONENT,
    SHARED_TIER_METRICS_PORT,
    SHARED_TIER_PORT,
    TENANT_TABLE_KEY,
    Obj,
    Owner,
    config_map_name,
    keys_secret_name,
    metadata,
    object_labels,
    restricted_container_security,
    restricted_pod_security,
    selector_labels,
    shared_tier_name,
)
from kvfleet_runtime.config import EngineSettings, LMCacheSettings

__all__ = [
    "SHARED_TIER_OVERHEAD",
    "build_shared_tier_deployment",
    "build_shared_tier_service",
    "shared_tier_bytes",
    "shared_tier_host",
    "with_shared_tier",
]

#: Memory of the server process besides the chunks it holds (Python, buffers of requests in flight).
SHARED_TIER_OVERHEAD = 1 << 30


def shared_tier_bytes(md: ModelDeployment) -> int:
    """The tier's size in bytes; 0 when the ModelDeployment has no enabled shared tier."""
    shared = md.spec.kv_cache.shared
    return parse_quantity(shared.size) if shared is not None and shared.enabled else 0


def shared_tier_host(namespace: str, model_deployment: str) -> str:
    """The Service's cluster DNS name, as the replicas dial it."""
    return f"{shared_tier_name(model_deployment)}.{namespace}.svc"


def with_shared_tier(settings: EngineSettings, host: str, chunk_size: int) -> EngineSettings:
    """``settings`` whose LMCache stores to and reads from the shared tier at ``host``. A pool without a
    CPU or NVMe tier gets an LMCache server all the same (the launcher gives its L1 the minimum), because
    LMCache is what talks to the shared tier."""
    lmcache = settings.lmcache or LMCacheSettings(cpu_bytes=1, chunk_size=chunk_size)
    shared = lmcache.model_copy(update={"shared_host": host, "shared_port": SHARED_TIER_PORT})
    return settings.model_copy(update={"lmcache": shared})


def build_shared_tier_deployment(
    namespace: str, model_deployment: str, owner: Owner, image: str, size_bytes: int
) -> Obj:
    name = shared_tier_name(model_deployment)
    labels = object_labels(model_deployment, SHARED_TIER_COMPONENT)
    memory = str(size_bytes + SHARED_TIER_OVERHEAD)
    container: Obj = {
        "name": "shared-tier",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "kvfleet",
            "engine",
            "shared-tier",
            "--config",
            f"{CONFIG_DIR}/{TENANT_TABLE_KEY}",
            "--keys",
            f"{KEYS_DIR}/{KEY_FILE_KEY}",
            "--pool",
            SHARED_POOL,
            "--size-bytes",
            str(size_bytes),
            "--host",
            "0.0.0.0",
            "--port",
            str(SHARED_TIER_PORT),
            "--metrics-port",
            str(SHARED_TIER_METRICS_PORT),
        ],
        "ports": [
            {"name": "kv", "containerPort": SHARED_TIER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": SHARED_TIER_METRICS_PORT, "protocol": "TCP"},
        ],
        # Requests equal limits: the tier's memory is reserved, and it is the first thing to go under
        # node pressure only if the platform says so (priorityClassName), not by being overcommitted.
        "resources": {
            "requests": {"cpu": "1", "memory": memory},
            "limits": {"memory": memory},
        },
        "readinessProbe": {"tcpSocket": {"port": "kv"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 15},
        "securityContext": restricted_container_security(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},  # the root filesystem is read-only
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, namespace, labels, owner),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector_labels(model_deployment, SHARED_TIER_COMPONENT)},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": restricted_pod_security(),
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": config_map_name(model_deployment)}},
                        {"name": "keys", "secret": {"secretName": keys_secret_name(model_deployment)}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def build_shared_tier_service(namespace: str, model_deployment: str, owner: Owner) -> Obj:
    """ClusterIP on the KV port only (scrapers reach the metrics port on the pod)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            shared_tier_name(model_deployment),
            namespace,
            object_labels(model_deployment, SHARED_TIER_COMPONENT),
            owner,
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(model_deployment, SHARED_TIER_COMPONENT),
            "ports": [{"name": "kv", "port": SHARED_TIER_PORT, "targetPort": "kv", "protocol": "TCP"}],
        },
    }
