"""The tenant-aware gateway of one ModelDeployment: Deployment, Service, PodDisruptionBudgets. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_operator.build.common import (
    CONFIG_DIR,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    KEY_FILE_KEY,
    KEYS_DIR,
    TENANT_TABLE_KEY,
    Obj,
    Owner,
    config_map_name,
    engine_name,
    gateway_name,
    keys_secret_name,
    metadata,
    object_labels,
    restricted_container_security,
    restricted_pod_security,
    selector_labels,
)


@dataclass(frozen=True)
class GatewayWorkload:
    namespace: str
    model_deployment: str
    owner: Owner
    replicas: int
    image: str
    cpu_request: str = "500m"
    memory_request: str = "256Mi"
    memory_limit: str = "1Gi"
    service_type: str = "ClusterIP"


def build_gateway_deployment(g: GatewayWorkload) -> Obj:
    name = gateway_name(g.model_deployment)
    labels = object_labels(g.model_deployment, "gateway")
    container: Obj = {
        "name": "gateway",
        "image": g.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "kvfleet",
            "gateway",
            "--config",
            f"{CONFIG_DIR}/{TENANT_TABLE_KEY}",
            "--keys",
            f"{KEYS_DIR}/{KEY_FILE_KEY}",
            "--listen",
            f"0.0.0.0:{GATEWAY_PORT}",
            "--metrics-listen",
            f"0.0.0.0:{GATEWAY_METRICS_PORT}",
            # Each replica enforces 1/replicas of every tenant's rate limits.
            "--replicas",
            str(g.replicas),
        ],
        "ports": [
            {"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": GATEWAY_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": {
            "requests": {"cpu": g.cpu_request, "memory": g.memory_request},
            "limits": {"memory": g.memory_limit},
        },
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10},
        "securityContext": restricted_container_security(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, g.namespace, labels, g.owner),
        "spec": {
            "replicas": g.replicas,
            "selector": {"matchLabels": selector_labels(g.model_deployment, "gateway")},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": restricted_pod_security(),
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": config_map_name(g.model_deployment)}},
                        {"name": "keys", "secret": {"secretName": keys_secret_name(g.model_deployment)}},
                    ],
                },
            },
        },
    }


def build_gateway_service(g: GatewayWorkload) -> Obj:
    name = gateway_name(g.model_deployment)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(name, g.namespace, object_labels(g.model_deployment, "gateway"), g.owner),
        "spec": {
            "type": g.service_type,
            "selector": selector_labels(g.model_deployment, "gateway"),
            "ports": [
                {"name": "http", "port": GATEWAY_PORT, "targetPort": "http", "protocol": "TCP"},
                # For the ServiceMonitor; the NetworkPolicy admits only labelled scrapers to it.
                {"name": "metrics", "port": GATEWAY_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def gateway_endpoint(g: GatewayWorkload) -> str:
    return f"http://{gateway_name(g.model_deployment)}.{g.namespace}.svc:{GATEWAY_PORT}/v1"


def build_pdb(
    *, namespace: str, model_deployment: str, component: str, pool: str | None, owner: Owner, name: str
) -> Obj:
    """At most one replica of a component down at a time during voluntary disruptions."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(name, namespace, object_labels(model_deployment, component, pool), owner),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(model_deployment, component, pool)},
        },
    }


def build_gateway_pdb(g: GatewayWorkload) -> Obj:
    return build_pdb(
        namespace=g.namespace,
        model_deployment=g.model_deployment,
        component="gateway",
        pool=None,
        owner=g.owner,
        name=gateway_name(g.model_deployment),
    )


def build_engine_pdb(namespace: str, model_deployment: str, pool: str, owner: Owner) -> Obj:
    return build_pdb(
        namespace=namespace,
        model_deployment=model_deployment,
        component="engine",
        pool=pool,
        owner=owner,
        name=engine_name(model_deployment, pool),
    )
