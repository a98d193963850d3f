"""Gateway exposure (``spec.gateway.exposure``): the client and metrics Services, the Ingress, the HTTPRoute,
``status.endpoint``, and how the reconcile withholds what it may not or cannot create. Pure, table-driven.

The same objects go to the real API server in tests/cluster/test_exposure.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_crds_cel import admit

from kvfleet_operator.api import ModelDeployment, reasons
from kvfleet_operator.api.modeldeployment import ExposureSpec
from kvfleet_operator.build.common import GATEWAY_METRICS_PORT, GATEWAY_PORT, Owner, object_labels
from kvfleet_operator.build.gateway import (
    GatewayWorkload,
    build_gateway_exposure,
    build_gateway_http_route,
    build_gateway_ingress,
    build_gateway_metrics_service,
    build_gateway_service,
    gateway_endpoint,
    load_balancer_address,
)
from kvfleet_operator.build.model_deployment import OperatorImages, compute_endpoint
from kvfleet_operator.build.network import build_gateway_network_policy
from kvfleet_operator.k8s import kinds
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile import steps
from kvfleet_operator.reconcile.status import WorkloadReadiness

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
OWNER = Owner("kvfleet.io/v1alpha1", "ModelDeployment", "m", "md-uid")
CLUSTER_URL = f"http://m-gateway.ns.svc:{GATEWAY_PORT}/v1"
INGRESS = {"host": "llm.example.com", "className": "nginx", "annotations": {"a.io/x": "1"}}
TLS_INGRESS = {**INGRESS, "tls": {"secretName": "llm-tls"}}
ROUTE = {
    "parentRefs": [{"name": "edge", "namespace": "gateways", "sectionName": "https"}, {"name": "internal"}],
    "hostnames": ["llm.example.com", "llm.example.org"],
}


def _gateway(**exposure: Any) -> GatewayWorkload:
    return GatewayWorkload(
        namespace="ns",
        model_deployment="m",
        owner=OWNER,
        replicas=2,
        image="gw:1",
        exposure=ExposureSpec.model_validate(exposure),
    )


def _lb_service(*entries: dict[str, str]) -> dict[str, Any]:
    """The client Service as read, with what a cloud's load balancer controller writes on it."""
    return {"kind": "Service", "status": {"loadBalancer": {"ingress": list(entries)}}}


# --- Services ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("service_type", ["ClusterIP", "LoadBalancer", "NodePort"])
def test_the_metrics_port_is_never_on_the_client_service(service_type: str) -> None:
    """The known bug this fixes: a LoadBalancer published the metrics port (every tenant's series) to
    whoever reached the load balancer. The metrics have their own ClusterIP Service, whatever the type."""
    g = _gateway(service={"type": service_type})
    client, metrics = build_gateway_service(g), build_gateway_metrics_service(g)
    assert client["spec"]["type"] == service_type
    assert [p["port"] for p in client["spec"]["ports"]] == [GATEWAY_PORT]
    assert metrics["spec"]["type"] == "ClusterIP"
    assert [p["port"] for p in metrics["spec"]["ports"]] == [GATEWAY_METRICS_PORT]
    assert metrics["spec"]["selector"] == client["spec"]["selector"]
    assert metrics["metadata"]["name"] != client["metadata"]["name"]


def test_service_annotations_only_when_asked() -> None:
    """Builders emit what the server stores: no empty annotations map (drift planning compares them)."""
    assert "annotations" not in build_gateway_service(_gateway())["metadata"]
    lb = build_gateway_service(
        _gateway(service={"type": "LoadBalancer", "annotations": {"cloud.io/internal": "true"}})
    )
    assert lb["metadata"]["annotations"] == {"cloud.io/internal": "true"}


# --- Ingress and HTTPRoute --------------------------------------------------------------------------


def test_no_exposure_objects_by_default() -> None:
    assert build_gateway_exposure(_gateway()) == []
    assert build_gateway_ingress(_gateway()) is None and build_gateway_http_route(_gateway()) is None


def test_ingress_routes_v1_of_the_host_to_the_client_service_with_tls_from_the_secret() -> None:
    ingress = build_gateway_ingress(_gateway(ingress=TLS_INGRESS))
    assert ingress is not None
    assert (ingress["apiVersion"], ingress["kind"]) == ("networking.k8s.io/v1", "Ingress")
    assert ingress["metadata"]["name"] == "m-gateway"
    assert ingress["metadata"]["labels"] == object_labels("m", "gateway")  # listed as an owned child
    assert ingress["metadata"]["ownerReferences"][0]["uid"] == "md-uid"
    assert ingress["metadata"]["annotations"] == {"a.io/x": "1"}
    assert ingress["spec"] == {
        "ingressClassName": "nginx",
        "tls": [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}],
        "rules": [
            {
                "host": "llm.example.com",
                "http": {
                    "paths": [
                        {
                            "path": "/v1",
                            "pathType": "Prefix",
                            "backend": {"service": {"name": "m-gateway", "port": {"number": GATEWAY_PORT}}},
                        }
                    ]
                },
            }
        ],
    }


def test_ingress_without_class_or_tls_sets_neither() -> None:
    ingress = build_gateway_ingress(_gateway(ingress={"host": "llm.example.com"}))
    assert ingress is not None
    assert set(ingress["spec"]) == {"rules"} and "annotations" not in ingress["metadata"]


def test_http_route_attaches_to_its_gateways_and_routes_v1_to_the_client_service() -> None:
    route = build_gateway_http_route(_gateway(httpRoute=ROUTE))
    assert route is not None
    assert (route["apiVersion"], route["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    assert route["metadata"]["labels"] == object_labels("m", "gateway")
    assert route["spec"] == {
        "parentRefs": [
            {"name": "edge", "namespace": "gateways", "sectionName": "https"},
            {"name": "internal"},
        ],
        "hostnames": ["llm.example.com", "llm.example.org"],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                "backendRefs": [{"name": "m-gateway", "port": GATEWAY_PORT}],
            }
        ],
    }
    assert [o["kind"] for o in build_gateway_exposure(_gateway(httpRoute=ROUTE))] == ["HTTPRoute"]


def test_the_gateway_policy_admits_any_client_on_the_api_port_only() -> None:
    """The NetworkPolicy decision for exposure: ingress controllers, Gateway implementations and a
    LoadBalancer's traffic (from any namespace, node or outside address) reach the API port like any
    client, with no rule to add; the metrics port stays scrapers-only."""
    policy = build_gateway_network_policy("ns", "m", OWNER)
    api, metrics = policy["spec"]["ingress"]
    assert api == {"ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]}  # no "from": every peer
    assert metrics["ports"] == [{"protocol": "TCP", "port": GATEWAY_METRICS_PORT}] and metrics["from"]


# --- status.endpoint --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exposure", "live", "withheld", "endpoint"),
    [
        pytest.param({}, None, (), CLUSTER_URL, id="cluster-ip"),
        pytest.param({"service": {"type": "NodePort"}}, None, (), CLUSTER_URL, id="node-port-no-single-url"),
        pytest.param({"ingress": INGRESS}, None, (), "http://llm.example.com/v1", id="ingress-plain"),
        pytest.param({"ingress": TLS_INGRESS}, None, (), "https://llm.example.com/v1", id="ingress-tls"),
        pytest.param({"ingress": TLS_INGRESS}, None, ("Ingress",), CLUSTER_URL, id="ingress-withheld"),
        pytest.param({"httpRoute": ROUTE}, None, (), "https://llm.example.com/v1", id="route-https"),
        pytest.param(
            {"httpRoute": {**ROUTE, "https": False}}, None, (), "http://llm.example.com/v1", id="route-http"
        ),
        pytest.param({"httpRoute": ROUTE}, None, ("HTTPRoute",), CLUSTER_URL, id="route-withheld"),
        pytest.param({"service": {"type": "LoadBalancer"}}, None, (), CLUSTER_URL, id="lb-not-read"),
        pytest.param(
            {"service": {"type": "LoadBalancer"}}, _lb_service(), (), CLUSTER_URL, id="lb-not-assigned-yet"
        ),
        pytest.param(
            {"service": {"type": "LoadBalancer"}},
            _lb_service({"ip": "203.0.113.7"}),
            (),
            f"http://203.0.113.7:{GATEWAY_PORT}/v1",
            id="lb-ip",
        ),
        pytest.param(
            {"service": {"type": "LoadBalancer"}},
            _lb_service({"hostname": "a1b2.elb.example.com"}, {"ip": "203.0.113.8"}),
            (),
            f"http://a1b2.elb.example.com:{GATEWAY_PORT}/v1",
            id="lb-hostname-first",
        ),
        pytest.param(
            {"service": {"type": "LoadBalancer"}},
            _lb_service({"ip": "2001:db8::7"}),
            (),
            f"http://[2001:db8::7]:{GATEWAY_PORT}/v1",
            id="lb-ipv6",
        ),
        pytest.param(
            {"service": {"type": "LoadBalancer"}, "ingress": TLS_INGRESS},
            _lb_service({"ip": "203.0.113.7"}),
            (),
            "https://llm.example.com/v1",
            id="the-route-host-wins-over-the-lb",
        ),
        pytest.param(
            {"service": {"type": "ClusterIP"}},
            _lb_service({"ip": "203.0.113.7"}),
            (),
            CLUSTER_URL,
            id="stale-lb-status-of-a-cluster-ip",
        ),
    ],
)
def test_endpoint(
    exposure: dict[str, Any], live: dict[str, Any] | None, withheld: tuple[str, ...], endpoint: str
) -> None:
    assert gateway_endpoint(_gateway(**exposure), live, withheld) == endpoint


def test_load_balancer_address_skips_empty_entries() -> None:
    assert load_balancer_address(_lb_service({}, {"ip": "198.51.100.1"})) == "198.51.100.1"
    assert load_balancer_address({"status": {}}) is None and load_balancer_address(None) is None


def _tiny(**exposure: Any) -> ModelDeployment:
    doc = yaml.safe_load((EXAMPLES / "local/modeldeployment-tiny.yaml").read_text())
    doc["metadata"]["uid"] = "md-uid"
    doc["spec"]["gateway"]["exposure"] = exposure
    return ModelDeployment.model_validate(doc)


def test_compute_endpoint_reads_the_live_client_service_only() -> None:
    """The reconcile passes every child as listed: only the client Service's status counts (the metrics
    Service is ClusterIP and never has a load balancer address)."""
    md = _tiny(service={"type": "LoadBalancer"})
    images = OperatorImages(engine="e", gateway="g")
    metrics = {**_lb_service({"ip": "10.9.9.9"}), "metadata": {"name": "tiny-gateway-metrics"}}
    client = {**_lb_service({"ip": "203.0.113.9"}), "metadata": {"name": "tiny-gateway"}}
    assert compute_endpoint(md, images, [metrics]) == "http://tiny-gateway.kvfleet-demo.svc:8080/v1"
    assert compute_endpoint(md, images, [metrics, client]) == "http://203.0.113.9:8080/v1"


# --- the API ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exposure",
    [
        pytest.param({}, id="default"),
        pytest.param({"service": {"type": "LoadBalancer", "annotations": {"x.io/y": "z"}}}, id="lb"),
        pytest.param({"ingress": TLS_INGRESS}, id="ingress"),
        pytest.param({"service": {"type": "NodePort"}, "httpRoute": ROUTE}, id="route"),
    ],
)
def test_valid_exposures_pass_the_schema_rules_and_the_model(exposure: dict[str, Any]) -> None:
    doc = yaml.safe_load((EXAMPLES / "local/modeldeployment-tiny.yaml").read_text())
    doc["spec"]["gateway"]["exposure"] = copy.deepcopy(exposure)
    assert admit("ModelDeployment", doc) == []
    parsed = ModelDeployment.model_validate(doc).spec.gateway.exposure
    dumped = parsed.model_dump(by_alias=True, exclude_none=True, mode="json")
    for key, value in exposure.items():
        assert {k: dumped[key][k] for k in value} == value  # what was written is what the builders get


def test_exposure_defaults_to_a_cluster_ip_service() -> None:
    exposure = _tiny().spec.gateway.exposure
    assert exposure.service.type.value == "ClusterIP"
    assert exposure.ingress is None and exposure.http_route is None


# --- the reconcile: what it lists and what it withholds --------------------------------------------


@pytest.mark.parametrize(
    ("managed", "listed"),
    [
        pytest.param((), set(), id="none-by-default"),
        pytest.param((kinds.INGRESS,), {kinds.INGRESS}, id="ingress"),
        pytest.param(kinds.EXPOSURE_KINDS, set(kinds.EXPOSURE_KINDS), id="both"),
    ],
)
def test_only_the_managed_exposure_kinds_are_listed(
    managed: tuple[kinds.Kind, ...], listed: set[kinds.Kind]
) -> None:
    found = steps.child_kinds(True, managed)
    assert set(found) & set(kinds.EXPOSURE_KINDS) == listed
    assert kinds.SERVICE in found and kinds.SERVICE_MONITOR in found
    assert found == [k for k in kinds.CHILD_KINDS if k in found]  # apply order kept


def test_parse_exposure_kinds() -> None:
    assert kinds.parse_exposure_kinds(None) == () and kinds.parse_exposure_kinds("") == ()
    assert kinds.parse_exposure_kinds(" HTTPRoute,Ingress,HTTPRoute ") == (kinds.HTTP_ROUTE, kinds.INGRESS)
    with pytest.raises(ValueError, match="unknown exposure kind 'Gateway'"):
        kinds.parse_exposure_kinds("Ingress,Gateway")


DESIRED = [
    build_gateway_service(_gateway()),
    *build_gateway_exposure(_gateway(ingress=INGRESS)),
    *build_gateway_exposure(_gateway(httpRoute=ROUTE)),
]


@pytest.mark.parametrize(
    ("managed", "unserved", "kept", "why"),
    [
        pytest.param(
            kinds.EXPOSURE_KINDS, (), ["Service", "Ingress", "HTTPRoute"], {}, id="managed-and-served"
        ),
        pytest.param(
            (kinds.HTTP_ROUTE,),
            (),
            ["Service", "HTTPRoute"],
            {"Ingress": "rbac.ingress=true"},
            id="ingress-not-allowed",
        ),
        pytest.param(
            kinds.EXPOSURE_KINDS,
            (kinds.HTTP_ROUTE,),
            ["Service", "Ingress"],
            {"HTTPRoute": "does not serve gateway.networking.k8s.io/v1: install the Gateway API CRDs"},
            id="no-gateway-api-crds",
        ),
        pytest.param(
            (),
            (),
            ["Service"],
            {"Ingress": "rbac.ingress=true", "HTTPRoute": "rbac.httpRoute=true"},
            id="nothing-allowed",
        ),
    ],
)
def test_withhold_exposure(
    managed: tuple[kinds.Kind, ...], unserved: tuple[kinds.Kind, ...], kept: list[str], why: dict[str, str]
) -> None:
    desired, withheld = steps.withhold_exposure(DESIRED, managed, unserved)
    assert [o["kind"] for o in desired] == kept
    assert set(withheld) == set(why)
    for kind, part in why.items():
        assert part in withheld[kind] and "reachable in the cluster only" in withheld[kind]


UP = WorkloadReadiness(wanted=1, ready=1)
DOWN = WorkloadReadiness(wanted=1, ready=0)


def _conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


@pytest.mark.parametrize(
    ("engines", "placement", "expected"),
    [
        pytest.param(
            UP,
            None,
            {
                "Ready": ("True", "Ready"),
                "Progressing": ("False", "Ready"),
                "Degraded": ("True", "ExposureUnavailable"),
            },
            id="serving-in-the-cluster-but-degraded",
        ),
        pytest.param(
            DOWN,
            None,
            {
                "Ready": ("False", "WaitingForReplicas"),
                "Progressing": ("True", "WaitingForReplicas"),
                "Degraded": ("True", "ExposureUnavailable"),
            },
            id="starting",
        ),
        pytest.param(
            DOWN,
            "no node has nvidia.com/gpu",
            {
                "Ready": ("False", "NoMatchingNodes"),
                "Progressing": ("True", "NoMatchingNodes"),
                "Degraded": ("True", "NoMatchingNodes"),
            },
            id="no-nodes-is-the-worse-problem",
        ),
    ],
)
def test_exposure_unavailable_condition(
    engines: WorkloadReadiness, placement: str | None, expected: dict[str, tuple[str, str]]
) -> None:
    md = _tiny(ingress=INGRESS)
    why = "spec.gateway.exposure.ingress asks for an Ingress, but ..."
    status = st.compute_model_deployment_status(
        md, None, [], engines, UP, "http://x/v1", None, "2026-03-01T00:00:00Z", placement, why
    )
    assert _conditions(status) == expected
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == (why if degraded["reason"] == reasons.EXPOSURE_UNAVAILABLE else placement)
    without = st.compute_model_deployment_status(
        md, None, [], engines, UP, "http://x/v1", None, "2026-03-01T00:00:00Z", placement
    )
    assert _conditions(without)["Degraded"][1] != reasons.EXPOSURE_UNAVAILABLE
