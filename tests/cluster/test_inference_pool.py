"""kvfleet behind a Gateway API Inference Extension gateway on the real API server: the InferencePool the
operator renders per pool is accepted by GIE's own CRD (its schema and CEL rules, server-side), the
HTTPRoute's backend is the InferencePool (accepted by the Gateway API's CRD), the Endpoint Picker runs, and
without the CRD the ModelDeployment says what is missing and serves in the cluster.

The reconcile is the one every kopf handler calls (``reconcile_model_deployment``), in process, with the
exposure kinds the chart's ``rbac.inferencePool`` (and ``rbac.httpRoute``) would grant. The CRDs are GIE's
and the Gateway API's own (releases pinned in hack/build-cluster.sh), installed and removed by the test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_helpers import wait_for
from devcluster import ControlPlane

from gie_builders import CRD_API, CRDS, apply_crd
from kvfleet_operator.api import reasons
from kvfleet_operator.build.guardrails import Guardrails
from kvfleet_operator.k8s import kinds
from operator_support import (
    API,
    CONFIG,
    condition,
    converge,
    model_deployment,
    reconcile,
    tiny_namespace,
    workloads_ready,
)

MD = "tiny"
#: The chart's rbac.inferencePool and rbac.httpRoute on; guardrails that allow the route's host and
#: Gateway (the defaults allow the platform gateway's pods in the ModelDeployment's own namespace).
ALLOWED = dataclasses.replace(
    CONFIG,
    exposure=kinds.EXPOSURE_KINDS,
    guardrails=Guardrails(hosts=("llm.example.com",), parent_gateways=("{namespace}/*",)),
)
GATEWAY_PODS = {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "edge"}}


def _served(plane: ControlPlane, kind: kinds.Kind, namespace: str) -> bool:
    return plane.request("GET", kind.path(namespace))[0] == 200


def _install(plane: ControlPlane, name: str, kind: kinds.Kind, namespace: str) -> None:
    apply_crd(plane, name)
    wait_for(lambda: _served(plane, kind, namespace), timeout=60, what=f"{kind.kind} API served")


def _remove(plane: ControlPlane, name: str, kind: kinds.Kind, namespace: str) -> None:
    plane.request("DELETE", f"{CRD_API}/{name}")
    wait_for(lambda: not _served(plane, kind, namespace), timeout=60, what=f"{kind.kind} API gone")


def _set_gateway(plane: ControlPlane, namespace: str, **fields: Any) -> None:
    """Set fields of ``spec.gateway`` as ``kubectl edit`` would (a PUT of the whole object)."""
    md = model_deployment(plane, namespace, MD)
    md["spec"]["gateway"].update(fields)
    status, body = plane.request("PUT", f"{API}/namespaces/{namespace}/modeldeployments/{MD}", md)
    assert status == 200, body


def _front_doors_ready(plane: ControlPlane, namespace: str) -> None:
    """``workloads_ready`` plus the Endpoint Picker's Deployment (the API tier runs no controllers)."""
    workloads_ready(plane, namespace, MD)
    status, body = plane.request(
        "PATCH",
        kinds.DEPLOYMENT.path(namespace, f"{MD}-epp") + "/status",
        {"status": {"replicas": 1, "readyReplicas": 1}},
        content_type="application/merge-patch+json",
    )
    assert status in (200, 404), body


def _get(plane: ControlPlane, kind: kinds.Kind, namespace: str, name: str) -> dict[str, Any] | None:
    status, body = plane.request("GET", kind.path(namespace, name))
    assert status in (200, 404), body
    return body if status == 200 else None


def _degraded_by_exposure(plane: ControlPlane, namespace: str, config: Any) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        _front_doors_ready(plane, namespace)
        reconcile(plane, namespace, MD, config)
        md = model_deployment(plane, namespace, MD)
        degraded = condition(md, "Degraded")
        if degraded.get("reason") != reasons.EXPOSURE_UNAVAILABLE or condition(md)["status"] != "True":
            return None
        return degraded

    found: dict[str, Any] = wait_for(
        check, timeout=60, interval=0.5, what="Degraded=ExposureUnavailable with Ready=True"
    )
    return found


@pytest.fixture
def namespace(api_cluster: ControlPlane) -> Iterator[str]:
    yield from tiny_namespace(api_cluster, "gie", ("basic-a",), schedulable=True)


def test_without_the_right_or_the_crd_a_condition_says_what_is_missing(
    api_cluster: ControlPlane, namespace: str
) -> None:
    plane = api_cluster
    pools, _ = CRDS
    _remove(plane, pools, kinds.INFERENCE_POOL, namespace)
    _set_gateway(plane, namespace, inferencePool={"gatewayPods": GATEWAY_PODS})

    # rbac.inferencePool off (the chart's default): no InferencePool, and the status says which value.
    degraded = _degraded_by_exposure(plane, namespace, CONFIG)
    assert "spec.gateway.inferencePool" in degraded["message"], degraded
    assert "rbac.inferencePool=true" in degraded["message"], degraded

    # Allowed, but the cluster has no InferencePool CRD: what to install, and everything else applied.
    degraded = _degraded_by_exposure(plane, namespace, ALLOWED)
    assert "does not serve inference.networking.k8s.io/v1" in degraded["message"], degraded
    assert "InferencePool CRD" in degraded["message"], degraded
    assert _get(plane, kinds.DEPLOYMENT, namespace, f"{MD}-epp") is not None
    assert _get(plane, kinds.SERVICE, namespace, f"{MD}-epp") is not None
    # Nothing admits the platform gateway while no InferencePool exists.
    engine_policy = _get(plane, kinds.NETWORK_POLICY, namespace, f"{MD}-engine")
    assert engine_policy is not None
    peers = [p for rule in engine_policy["spec"]["ingress"] for p in rule.get("from", [])]
    assert not any(p.get("podSelector") == GATEWAY_PODS for p in peers), peers
    md = model_deployment(plane, namespace, MD)
    assert condition(md)["status"] == "True", md["status"]  # still serving in the cluster
    converge(plane, namespace, MD, config=ALLOWED)  # and it does not keep writing


def test_the_inference_pool_is_accepted_by_gies_crd_and_the_route_goes_to_it(
    api_cluster: ControlPlane, namespace: str
) -> None:
    plane = api_cluster
    pools, routes = CRDS
    try:
        _install(plane, pools, kinds.INFERENCE_POOL, namespace)
        _install(plane, routes, kinds.HTTP_ROUTE, namespace)
        _set_gateway(
            plane,
            namespace,
            inferencePool={"gatewayPods": GATEWAY_PODS},
            exposure={"httpRoute": {"parentRefs": [{"name": "edge"}], "hostnames": ["llm.example.com"]}},
        )
        _front_doors_ready(plane, namespace)
        converge(plane, namespace, MD, config=ALLOWED)
        _front_doors_ready(plane, namespace)
        converge(plane, namespace, MD, config=ALLOWED)

        # Server-side validation by GIE's CRD accepted it; what it stored is what the operator meant.
        live = _get(plane, kinds.INFERENCE_POOL, namespace, f"{MD}-engine")
        assert live is not None
        spec = live["spec"]
        assert spec["targetPorts"] == [{"number": 8000}]
        assert spec["selector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
        assert spec["selector"]["matchLabels"]["kvfleet.io/pool"] == "shared"
        ref = spec["endpointPickerRef"]
        assert (ref["name"], ref["kind"], ref["port"], ref["failureMode"]) == (
            f"{MD}-epp",
            "Service",
            {"number": 9002},
            "FailClose",
        )
        assert live["metadata"]["ownerReferences"][0]["name"] == MD
        service = _get(plane, kinds.SERVICE, namespace, ref["name"])
        assert service is not None
        assert {p["port"] for p in service["spec"]["ports"]} == {9002, 9090}
        # The engines' pods are the ones the pool selects.
        statefulset = _get(plane, kinds.STATEFUL_SET, namespace, f"{MD}-engine")
        assert statefulset is not None
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()

        # The route's backend is the InferencePool, accepted by the Gateway API's CRD.
        route = _get(plane, kinds.HTTP_ROUTE, namespace, f"{MD}-gateway")
        assert route is not None
        (rule,) = route["spec"]["rules"]
        (backend,) = rule["backendRefs"]
        assert (backend["group"], backend["kind"], backend["name"]) == (
            "inference.networking.k8s.io",
            "InferencePool",
            f"{MD}-engine",
        )
        md = model_deployment(plane, namespace, MD)
        assert condition(md, "Degraded").get("reason") != reasons.EXPOSURE_UNAVAILABLE, md["status"]
        assert condition(md)["status"] == "True", md["status"]

        # Envoy as the data plane: the gateway pods run Envoy, and what the API server stores of them (a
        # tcpSocket probe, no metrics port) converges: a second reconcile writes nothing.
        # TLS on the picker's port, from a Secret (its CA mounted in the Envoy pods).
        _set_gateway(plane, namespace, dataPlane="envoy", endpointPicker={"tlsSecretName": "tiny-epp-tls"})
        converge(plane, namespace, MD, config=ALLOWED)
        epp = _get(plane, kinds.DEPLOYMENT, namespace, f"{MD}-epp")
        assert epp is not None
        (picker,) = epp["spec"]["template"]["spec"]["containers"]
        assert "--tls-cert" in picker["command"] and picker["readinessProbe"]["tcpSocket"] == {"port": "grpc"}
        gateway = _get(plane, kinds.DEPLOYMENT, namespace, f"{MD}-gateway")
        assert gateway is not None
        (envoy,) = gateway["spec"]["template"]["spec"]["containers"]
        assert envoy["command"][:2] == ["kvfleet", "envoy"]
        assert f"{MD}-epp.{namespace}.svc:9002" in envoy["command"] and "--epp-ca" in envoy["command"]
        assert _get(plane, kinds.SERVICE, namespace, f"{MD}-gateway-metrics") is None

        # Removed from the spec: the InferencePool, the picker and its policy go with it.
        md = model_deployment(plane, namespace, MD)
        md["spec"]["gateway"]["dataPlane"] = "kvfleet"
        md["spec"]["gateway"]["endpointPicker"] = {}
        del md["spec"]["gateway"]["inferencePool"]
        status, body = plane.request("PUT", f"{API}/namespaces/{namespace}/modeldeployments/{MD}", md)
        assert status == 200, body
        converge(plane, namespace, MD, config=ALLOWED)
        assert _get(plane, kinds.INFERENCE_POOL, namespace, f"{MD}-engine") is None
        assert _get(plane, kinds.DEPLOYMENT, namespace, f"{MD}-epp") is None
        assert _get(plane, kinds.NETWORK_POLICY, namespace, f"{MD}-epp") is None
        route = _get(plane, kinds.HTTP_ROUTE, namespace, f"{MD}-gateway")
        assert route is not None
        assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == f"{MD}-gateway"
    finally:
        for name, kind in ((pools, kinds.INFERENCE_POOL), (routes, kinds.HTTP_ROUTE)):
            _remove(plane, name, kind, namespace)
