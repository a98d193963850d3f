"""Prometheus Operator objects (build/monitoring.py): what they select and which ports they scrape."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_operator.build.common import ENGINE_PORT, PLUGIN_METRICS_PORT, Owner, selector_labels
from kvfleet_operator.build.engine import PoolWorkload, build_engine_statefulset
from kvfleet_operator.build.gateway import (
    GatewayWorkload,
    build_gateway_deployment,
    build_gateway_metrics_service,
    build_gateway_service,
)
from kvfleet_operator.build.monitoring import build_engine_pod_monitor, build_gateway_service_monitor
from object_fields import field_at

OWNER = Owner("kvfleet.io/v1alpha1", "ModelDeployment", "m", "md-uid")
GATEWAY = GatewayWorkload(namespace="ns", model_deployment="m", owner=OWNER, replicas=1, image="gw:1")


def _pool(pool: str) -> PoolWorkload:
    return PoolWorkload(
        namespace="ns",
        model_deployment="m",
        pool=pool,
        owner=OWNER,
        replicas=1,
        image="e:1",
        model="x",
        gpus_per_replica=1,
    )


@pytest.mark.parametrize(
    ("monitor", "expected"),
    [
        pytest.param(
            build_gateway_service_monitor(GATEWAY),
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "ServiceMonitor",
                "metadata.name": "m-gateway",
                "metadata.ownerReferences[0].uid": "md-uid",
                "spec.selector.matchLabels": selector_labels("m", "gateway"),
                "spec.endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
            },
            id="gateway-service-monitor",
        ),
        pytest.param(
            build_engine_pod_monitor("ns", "m", OWNER),
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "PodMonitor",
                "metadata.name": "m-engines",
                "metadata.ownerReferences[0].uid": "md-uid",
                "spec.selector.matchLabels": selector_labels("m", "engine"),  # every pool: no pool label
                # One port per engine pod, serving every series and no inference API.
                "spec.podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
            },
            id="engine-pod-monitor",
        ),
    ],
)
def test_monitor_fields(monitor: dict[str, Any], expected: dict[str, Any]) -> None:
    assert {path: field_at(monitor, path) for path in expected} == expected


def test_service_monitor_scrapes_a_port_the_gateway_service_names() -> None:
    """It selects the gateway's Services by label and scrapes the ``metrics`` port, which only the
    ClusterIP metrics Service has (the client Service, which may be a LoadBalancer, does not)."""
    monitor = build_gateway_service_monitor(GATEWAY)
    service = build_gateway_metrics_service(GATEWAY)
    client = build_gateway_service(GATEWAY)
    assert not {e["port"] for e in monitor["spec"]["endpoints"]} & {
        p["name"] for p in client["spec"]["ports"]
    }
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    pod_labels = build_gateway_deployment(GATEWAY)["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.parametrize("pool", ["shared", "dedicated-bank"])
def test_pod_monitor_selects_every_engine_pool_on_its_metrics_port_only(pool: str) -> None:
    monitor = build_engine_pod_monitor("ns", "m", OWNER)
    sts = build_engine_statefulset(_pool(pool))
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container_ports = {
        p["name"]: p["containerPort"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    scraped = {container_ports[e["port"]] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert scraped == {PLUGIN_METRICS_PORT}  # never vLLM's inference port
    assert ENGINE_PORT in container_ports.values()


def test_pod_monitor_does_not_select_gateway_pods() -> None:
    selector = build_engine_pod_monitor("ns", "m", OWNER)["spec"]["selector"]["matchLabels"]
    gateway_pods = build_gateway_deployment(GATEWAY)["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= gateway_pods.items()
