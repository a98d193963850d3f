"""The gateway's Deployment, Service and PodDisruptionBudgets (build/gateway.py), table-driven."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvfleet_operator.api.modeldeployment import ExposureSpec, ServiceExposure, ServiceType
from kvfleet_operator.build.common import (
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    Owner,
    object_labels,
    selector_labels,
)
from kvfleet_operator.build.engine import (
    NODE_LOSS_TAINTS,
    NODE_LOSS_TOLERATION_SECONDS,
    build_node_loss_tolerations,
)
from kvfleet_operator.build.gateway import (
    GatewayWorkload,
    build_engine_pdb,
    build_gateway_deployment,
    build_gateway_metrics_service,
    build_gateway_pdb,
    build_gateway_service,
    gateway_endpoint,
)
from object_fields import MISSING, field_at

OWNER = Owner("kvfleet.io/v1alpha1", "ModelDeployment", "m", "md-uid")
GATEWAY = GatewayWorkload(namespace="ns", model_deployment="m", owner=OWNER, replicas=2, image="gw:1")
POD = "spec.template.spec"
CONTAINER = f"{POD}.containers[0]"


@pytest.mark.parametrize(
    ("gateway", "expected"),
    [
        pytest.param(
            GATEWAY,
            {
                "metadata.name": "m-gateway",
                "metadata.namespace": "ns",
                "metadata.ownerReferences[0].uid": "md-uid",
                "spec.replicas": 2,
                f"{CONTAINER}.image": "gw:1",
                f"{CONTAINER}.resources": {
                    "requests": {"cpu": "500m", "memory": "256Mi"},
                    "limits": {"memory": "1Gi"},
                },
                f"{CONTAINER}.ports": [
                    {"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"},
                    {"name": "metrics", "containerPort": GATEWAY_METRICS_PORT, "protocol": "TCP"},
                ],
                f"{CONTAINER}.readinessProbe.httpGet": {"path": "/readyz", "port": "http"},
                f"{CONTAINER}.livenessProbe.httpGet": {"path": "/healthz", "port": "http"},
                # Rolling: keep serving 5 s after removal (endpoints catch up), then drain for up to 60 s.
                f"{CONTAINER}.lifecycle.preStop": {"sleep": {"seconds": 5}},
                f"{POD}.terminationGracePeriodSeconds": 75,
                f"{POD}.automountServiceAccountToken": False,
                f"{POD}.enableServiceLinks": False,
                f"{POD}.securityContext.runAsNonRoot": True,
                f"{CONTAINER}.securityContext.readOnlyRootFilesystem": True,
                f"{CONTAINER}.securityContext.capabilities": {"drop": ["ALL"]},
                # The gateway needs no GPU node; only the node-loss tolerations (30 s, not 300 s).
                f"{POD}.tolerations": [
                    {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}
                    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
                ],
                f"{POD}.nodeSelector": MISSING,
            },
            id="defaults",
        ),
        pytest.param(
            dataclasses.replace(
                GATEWAY, replicas=1, cpu_request="100m", memory_request="128Mi", memory_limit="2Gi"
            ),
            {
                "spec.replicas": 1,
                f"{CONTAINER}.resources": {
                    "requests": {"cpu": "100m", "memory": "128Mi"},
                    "limits": {"memory": "2Gi"},
                },
            },
            id="resources-from-the-spec",
        ),
    ],
)
def test_deployment_fields(gateway: GatewayWorkload, expected: dict[str, Any]) -> None:
    deployment = build_gateway_deployment(gateway)
    assert {path: field_at(deployment, path) for path in expected} == expected


def test_a_gateway_pod_leaves_a_lost_node_as_soon_as_an_engine_pod_does() -> None:
    """The API server's DefaultTolerationSeconds would keep a gateway pod bound to a node that stopped
    reporting for 300 s (its Deployment starts the replacement only once the pod is evicted)."""
    pod = build_gateway_deployment(GATEWAY)["spec"]["template"]["spec"]
    assert pod["tolerations"] == build_node_loss_tolerations(())
    assert {t["key"]: t["tolerationSeconds"] for t in pod["tolerations"]} == dict.fromkeys(
        NODE_LOSS_TAINTS, NODE_LOSS_TOLERATION_SECONDS
    )


def test_deployment_selects_its_pods_and_mounts_the_runtime_config() -> None:
    deployment = build_gateway_deployment(GATEWAY)
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == selector_labels("m", "gateway")
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert deployment["metadata"]["labels"] == object_labels("m", "gateway")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {"name": "config", "configMap": {"name": "m-tenants"}},
        {"name": "keys", "secret": {"secretName": "m-keys"}},
    ]
    command = pod["containers"][0]["command"]
    assert command[:2] == ["kvfleet", "gateway"]
    assert command[command.index("--listen") + 1] == f"0.0.0.0:{GATEWAY_PORT}"
    assert command[command.index("--metrics-listen") + 1] == f"0.0.0.0:{GATEWAY_METRICS_PORT}"
    assert command[command.index("--replicas") + 1] == "2"  # each replica enforces half the rate limits
    # The drain fits in the grace period after the preStop sleep, or the kubelet kills streams mid-drain.
    drain = int(command[command.index("--drain-timeout") + 1])
    prestop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert drain == 60 and prestop + drain < pod["terminationGracePeriodSeconds"]
    assert command[command.index("--config") + 1] == "/etc/kvfleet/config/tenants.json"
    assert command[command.index("--keys") + 1] == "/etc/kvfleet/keys/keys.json"
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert all(m["readOnly"] for m in mounts.values())


@pytest.mark.parametrize(
    ("gateway", "service_type"),
    [
        pytest.param(GATEWAY, "ClusterIP", id="cluster-ip-by-default"),
        pytest.param(
            dataclasses.replace(
                GATEWAY,
                exposure=ExposureSpec(service=ServiceExposure(type=ServiceType.LOAD_BALANCER)),
            ),
            "LoadBalancer",
            id="lb",
        ),
    ],
)
def test_service(gateway: GatewayWorkload, service_type: str) -> None:
    """The client Service carries the API port only, whatever its type (exposure: test_build_exposure.py);
    the metrics port is on its own ClusterIP Service."""
    svc = build_gateway_service(gateway)
    assert svc["metadata"]["name"] == "m-gateway"
    assert svc["spec"]["type"] == service_type
    assert svc["spec"]["selector"] == selector_labels("m", "gateway")
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": GATEWAY_PORT, "targetPort": "http", "protocol": "TCP"},
    ]
    metrics = build_gateway_metrics_service(gateway)
    assert metrics["metadata"]["name"] == "m-gateway-metrics"
    assert metrics["spec"]["type"] == "ClusterIP"
    assert metrics["spec"]["selector"] == selector_labels("m", "gateway")
    assert metrics["spec"]["ports"] == [
        {"name": "metrics", "port": GATEWAY_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
    ]


def test_endpoint_is_the_services_cluster_dns_name() -> None:
    assert gateway_endpoint(GATEWAY) == f"http://m-gateway.ns.svc:{GATEWAY_PORT}/v1"


@pytest.mark.parametrize(
    ("pdb", "name", "selector", "owner_kind"),
    [
        pytest.param(
            build_gateway_pdb(GATEWAY),
            "m-gateway",
            selector_labels("m", "gateway"),
            "ModelDeployment",
            id="gateway",
        ),
        pytest.param(
            build_engine_pdb("ns", "m", "shared", OWNER),
            "m-engine",
            selector_labels("m", "engine", "shared"),
            "ModelDeployment",
            id="shared-engines",
        ),
        pytest.param(
            build_engine_pdb(
                "ns", "m", "dedicated-bank", Owner("kvfleet.io/v1alpha1", "Tenant", "bank", "t")
            ),
            "m-dedicated-bank-engine",
            selector_labels("m", "engine", "dedicated-bank"),
            "Tenant",
            id="dedicated-engines-owned-by-the-tenant",
        ),
    ],
)
def test_pdb_allows_one_replica_down(
    pdb: dict[str, Any], name: str, selector: dict[str, str], owner_kind: str
) -> None:
    assert (pdb["apiVersion"], pdb["kind"]) == ("policy/v1", "PodDisruptionBudget")
    assert pdb["metadata"]["name"] == name
    assert pdb["metadata"]["ownerReferences"][0]["kind"] == owner_kind
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}


@pytest.mark.parametrize(
    ("exposure", "per_source"),
    [
        ({}, None),
        ({"service": {"type": "LoadBalancer"}}, "0"),
        ({"service": {"type": "NodePort"}}, "0"),
        ({"ingress": {"host": "llm.example.com"}}, "0"),
        ({"httpRoute": {"parentRefs": [{"name": "gw"}], "hostnames": ["llm.example.com"]}}, "0"),
    ],
)
def test_the_bound_per_source_address_is_off_where_a_proxy_hides_client_addresses(
    exposure: dict[str, Any], per_source: str | None
) -> None:
    """Issue 23, hole 8: behind an Ingress, an HTTPRoute or kube-proxy's SNAT every client shares a few
    addresses, so the gateway's bound per address (a quarter of its connections) would cap them all."""
    g = dataclasses.replace(GATEWAY, exposure=ExposureSpec.model_validate(exposure))
    command = field_at(build_gateway_deployment(g), f"{CONTAINER}.command")
    flag = "--max-connections-per-source"
    assert (command[command.index(flag) + 1] if flag in command else None) == per_source
