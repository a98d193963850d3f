"""Names, labels, ports and owner references shared by every builder. Pure."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_runtime import config

Obj = dict[str, Any]

MANAGED_BY = "kvfleet-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MODEL_DEPLOYMENT = "kvfleet.io/model-deployment"
LABEL_POOL = "kvfleet.io/pool"
LABEL_TENANT = "kvfleet.io/tenant"
LABEL_API_KEY = "kvfleet.io/api-key"
#: Pods (in any namespace) carrying this label may scrape engine metrics ports.
LABEL_SCRAPER = "kvfleet.io/metrics-scraper"
#: On an engine StatefulSet while its pool drains replicas away (``reconcile/drain.py``): JSON
#: ``{"serving": <replicas that stay>, "since": "<RFC 3339>"}``.
ANNOTATION_DRAIN = "kvfleet.io/drain"

# The pod's ports are part of the runtime's contract: their numbers live in kvfleet_runtime.config only.
ENGINE_PORT = config.ENGINE_PORT
PLUGIN_METRICS_PORT = config.PLUGIN_METRICS_PORT
LMCACHE_SYNC_METRICS_PORT = config.LMCACHE_SYNC_METRICS_PORT
LMCACHE_PORT = config.LMCACHE_PORT
LMCACHE_HTTP_PORT = config.LMCACHE_HTTP_PORT
KV_EVENTS_PORT = config.KV_EVENTS_PORT
GATEWAY_PORT = config.GATEWAY_PORT
GATEWAY_METRICS_PORT = config.GATEWAY_METRICS_PORT
SHARED_TIER_PORT = config.SHARED_TIER_PORT
EPP_PORT = config.EPP_PORT
EPP_METRICS_PORT = config.EPP_METRICS_PORT
ENVOY_ADMIN_PORT = config.ENVOY_ADMIN_PORT
SHARED_TIER_METRICS_PORT = config.SHARED_TIER_METRICS_PORT
#: The ``app.kubernetes.io/component`` of the shared KV tier's pod (``build/shared_tier.py``).
SHARED_TIER_COMPONENT = "shared-tier"
#: The ``app.kubernetes.io/component`` of the Endpoint Picker's pods (``build/endpoint_picker.py``).
EPP_COMPONENT = "epp"
#: The engine container's one port for Prometheus (``PLUGIN_METRICS_PORT``: every series of the pod, no
#: inference API); the PodMonitor scrapes it by this name.
ENGINE_METRICS_PORT_NAME = "metrics"

CONFIG_DIR = "/etc/kvfleet/config"
MODEL_MOUNT = "/models"
NVME_MOUNT = "/var/lib/kvfleet/nvme"
KEYS_DIR = "/etc/kvfleet/keys"
TENANT_TABLE_KEY = "tenants.json"
KEY_FILE_KEY = "keys.json"

SHARED_POOL = "shared"


@dataclass(frozen=True)
class Owner:
    """The object whose deletion garbage-collects a child."""

    api_version: str
    kind: str
    name: str
    uid: str

    def reference(self) -> Obj:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def owner_of(obj: ModelDeployment | Tenant) -> Owner:
    meta = obj.metadata
    return Owner(
        api_version=obj.api_version, kind=obj.kind, name=str(meta["name"]), uid=str(meta.get("uid", ""))
    )


def selector_labels(model_deployment: str, component: str, pool: str | None = None) -> dict[str, str]:
    labels = {
        LABEL_NAME: "kvfleet",
        LABEL_INSTANCE: model_deployment,
        LABEL_COMPONENT: component,
    }
    if pool is not None:
        labels[LABEL_POOL] = pool
    return labels


def object_labels(model_deployment: str, component: str, pool: str | None = None) -> dict[str, str]:
    """Labels on every child: the selector labels plus the ones the operator lists its children by."""
    return {
        **selector_labels(model_deployment, component, pool),
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_MODEL_DEPLOYMENT: model_deployment,
    }


def owned_selector(model_deployment: str) -> str:
    """Label selector that finds every child of one ModelDeployment."""
    return f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_MODEL_DEPLOYMENT}={model_deployment}"


def metadata(
    name: str, namespace: str, labels: dict[str, str], owner: Owner, annotations: dict[str, str] | None = None
) -> Obj:
    meta: Obj = {
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "ownerReferences": [owner.reference()],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def gateway_name(model_deployment: str) -> str:
    return f"{model_deployment}-gateway"


def engine_name(model_deployment: str, pool: str) -> str:
    return f"{model_deployment}-engine" if pool == SHARED_POOL else f"{model_deployment}-{pool}-engine"


def epp_name(model_deployment: str) -> str:
    """The Endpoint Picker's Deployment and Service (an InferencePool's ``endpointPickerRef``)."""
    return f"{model_deployment}-epp"


def shared_tier_name(model_deployment: str) -> str:
    return f"{model_deployment}-shared-tier"


def config_map_name(model_deployment: str) -> str:
    return f"{model_deployment}-tenants"


def keys_secret_name(model_deployment: str) -> str:
    return f"{model_deployment}-keys"


def restricted_container_security() -> Obj:
    """The container half of the ``restricted`` Pod Security level."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def restricted_pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
