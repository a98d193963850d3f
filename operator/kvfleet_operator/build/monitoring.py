"""Prometheus Operator objects, built only when the cluster serves monitoring.coreos.com/v1. Pure."""

from __future__ import annotations

from kvfleet_operator.build.common import (
    ENGINE_METRICS_PORT_NAME,
    EPP_COMPONENT,
    LABEL_INSTANCE,
    LABEL_NAME,
    SHARED_TIER_COMPONENT,
    Obj,
    Owner,
    epp_name,
    gateway_name,
    metadata,
    object_labels,
    selector_labels,
    shared_tier_name,
)
from kvfleet_operator.build.gateway import GatewayWorkload


def build_gateway_service_monitor(g: GatewayWorkload) -> Obj:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata(
            gateway_name(g.model_deployment),
            g.namespace,
            object_labels(g.model_deployment, "gateway"),
            g.owner,
        ),
        "spec": {
            "selector": {"matchLabels": selector_labels(g.model_deployment, "gateway")},
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
        },
    }


def build_epp_service_monitor(g: GatewayWorkload) -> Obj:
    """The Endpoint Picker's ``metrics`` port (the gateway's series: it runs the tenancy), through its
    Service (``<md>-epp``), whose other port, gRPC, is never scraped."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata(
            epp_name(g.model_deployment),
            g.namespace,
            object_labels(g.model_deployment, EPP_COMPONENT),
            g.owner,
        ),
        "spec": {
            "selector": {"matchLabels": selector_labels(g.model_deployment, EPP_COMPONENT)},
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
        },
    }


def build_engine_pod_monitor(namespace: str, model_deployment: str, owner: Owner) -> Obj:
    """All engine pods of the ModelDeployment (shared and dedicated pools), on their one metrics port
    (``ENGINE_METRICS_PORT_NAME``): it serves vLLM's, the plugin's, LMCache's and the quota sync's series
    and no inference API. Never vLLM's own port: the engine's NetworkPolicy admits scrapers to the metrics
    port only."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": metadata(
            f"{model_deployment}-engines", namespace, object_labels(model_deployment, "engine"), owner
        ),
        "spec": {
            "selector": {
                "matchLabels": {
                    LABEL_NAME: "kvfleet",
                    LABEL_INSTANCE: model_deployment,
                    "app.kubernetes.io/component": "engine",
                }
            },
            "podMetricsEndpoints": [
                {"port": ENGINE_METRICS_PORT_NAME, "path": "/metrics", "interval": "15s"}
            ],
        },
    }


def build_shared_tier_pod_monitor(namespace: str, model_deployment: str, owner: Owner) -> Obj:
    """The shared KV tier's pod on its ``metrics`` port (per-salt bytes, quotas, evictions, requests), the
    only port its NetworkPolicy opens to scrapers; never the KV port."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": metadata(
            shared_tier_name(model_deployment),
            namespace,
            object_labels(model_deployment, SHARED_TIER_COMPONENT),
            owner,
        ),
        "spec": {
            "selector": {"matchLabels": selector_labels(model_deployment, SHARED_TIER_COMPONENT)},
            "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
        },
    }
