"""NetworkPolicies: tenants reach engines only through the gateway. Pure."""

from __future__ import annotations

from kvfleet_operator.build.common import (
    ENGINE_PORT,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    LABEL_SCRAPER,
    LMCACHE_SYNC_METRICS_PORT,
    PLUGIN_METRICS_PORT,
    Obj,
    Owner,
    engine_name,
    gateway_name,
    metadata,
    object_labels,
    selector_labels,
)


def _ports(*ports: int) -> list[Obj]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def build_engine_network_policy(namespace: str, model_deployment: str, pool: str, owner: Owner) -> Obj:
    """Engine pods accept the gateway (inference) and labelled scrapers (metrics); nothing else.

    LMCache's ZMQ port is not listed: vLLM reaches it over the pod's loopback, which NetworkPolicy does
    not govern. Its HTTP API (quotas, clear) is reachable only from within the pod as well.
    """
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            engine_name(model_deployment, pool),
            namespace,
            object_labels(model_deployment, "engine", pool),
            owner,
        ),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(model_deployment, "engine", pool)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": selector_labels(model_deployment, "gateway")}}],
                    "ports": _ports(ENGINE_PORT),
                },
                {
                    "from": [
                        {
                            "namespaceSelector": {},
                            "podSelector": {"matchLabels": {LABEL_SCRAPER: "true"}},
                        }
                    ],
                    "ports": _ports(ENGINE_PORT, PLUGIN_METRICS_PORT, LMCACHE_SYNC_METRICS_PORT),
                },
            ],
        },
    }


def build_gateway_network_policy(namespace: str, model_deployment: str, owner: Owner) -> Obj:
    """The gateway is the front door: client traffic from anywhere on its API port; its metrics port
    only from labelled scrapers (the metrics name every tenant)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            gateway_name(model_deployment), namespace, object_labels(model_deployment, "gateway"), owner
        ),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(model_deployment, "gateway")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": _ports(GATEWAY_PORT)},
                {
                    "from": [
                        {"namespaceSelector": {}, "podSelector": {"matchLabels": {LABEL_SCRAPER: "true"}}}
                    ],
                    "ports": _ports(GATEWAY_METRICS_PORT),
                },
            ],
        },
    }
