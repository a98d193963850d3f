"""Gateway exposure (``spec.gateway.exposure``) on the real API server: the Services, the Ingress and the
HTTPRoute the operator applies, what the API server stores of them, and ``status.endpoint`` following.

The reconcile is the one every kopf handler calls (``reconcile_model_deployment``), in process, with the
exposure kinds the chart's ``rbac.ingress``/``rbac.httpRoute`` would grant. No cloud controller runs here:
the test writes a LoadBalancer Service's ``status.loadBalancer.ingress`` itself, as a cloud's load balancer
controller does once it has an address. The HTTPRoute CRD is the Gateway API's own (release pinned in
hack/build-cluster.sh), installed and removed by the test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import apply_crds, create_namespace, delete_namespace, wait_for
from devcluster import BUILD_COMMAND, ControlPlane, cache_dir
from test_chart_cluster import CHART, ChartOperator, helm, permission_error

from components import missing_component
from kvfleet_operator.api import reasons
from kvfleet_operator.api.modeldeployment import ServiceType
from kvfleet_operator.build.guardrails import Guardrails
from kvfleet_operator.handlers.reconcile import OperatorConfig
from kvfleet_operator.k8s import kinds
from operator_support import (
    API,
    CONFIG,
    condition,
    converge,
    create,
    get,
    load_example,
    model_deployment,
    reconcile,
    tiny_namespace,
    workloads_ready,
)

MD = "tiny"
#: The chart's rbac.ingress and rbac.httpRoute on, and guardrails that allow what these tests expose (the
#: defaults allow ClusterIP only and no host: tests/security/test_model_deployment_guardrails.py).
ALLOWED = dataclasses.replace(
    CONFIG,
    exposure=kinds.EXPOSURE_KINDS,
    guardrails=Guardrails(
        service_types=tuple(ServiceType),
        service_annotations=("lb.example.com/*",),
        ingress_classes=("nginx",),
        hosts=("llm.example.com",),
        parent_gateways=("gateways/edge",),
    ),
)
CLUSTER_URL = "http://tiny-gateway.{ns}.svc:8080/v1"
HTTPROUTE_CRD = "httproutes.gateway.networking.k8s.io"


def _set_exposure(plane: ControlPlane, namespace: str, exposure: dict[str, Any]) -> None:
    """Replace ``spec.gateway.exposure`` as ``kubectl edit`` would (a PUT of the whole object)."""
    md = model_deployment(plane, namespace, MD)
    md["spec"]["gateway"]["exposure"] = exposure
    status, body = plane.request("PUT", f"{API}/namespaces/{namespace}/modeldeployments/{MD}", md)
    assert status == 200, body


def _get(plane: ControlPlane, kind: kinds.Kind, namespace: str, name: str) -> dict[str, Any] | None:
    status, body = plane.request("GET", kind.path(namespace, name))
    assert status in (200, 404), body
    return body if status == 200 else None


def _degraded_by_exposure(plane: ControlPlane, namespace: str, config: OperatorConfig) -> dict[str, Any]:
    """Reconcile (workloads made ready) until ``Degraded`` says ``ExposureUnavailable``; that condition."""

    def check() -> dict[str, Any] | None:
        workloads_ready(plane, namespace, MD)
        reconcile(plane, namespace, MD, config)
        md = model_deployment(plane, namespace, MD)
        degraded = condition(md, "Degraded")
        # The exposure problem shows while replicas are still coming up too; wait for Ready as well, so the
        # caller reads a settled status (on a loaded machine the first rounds still count replicas).
        if degraded.get("reason") != reasons.EXPOSURE_UNAVAILABLE or condition(md)["status"] != "True":
            return None
        return degraded

    found: dict[str, Any] = wait_for(
        check, timeout=60, interval=0.5, what="Degraded=ExposureUnavailable with Ready=True"
    )
    return found


@pytest.fixture
def namespace(api_cluster: ControlPlane) -> Iterator[str]:
    yield from tiny_namespace(api_cluster, "exposure", ("basic-a",), schedulable=True)


def test_load_balancer_and_ingress_endpoint_follows(api_cluster: ControlPlane, namespace: str) -> None:
    plane = api_cluster
    cluster_url = CLUSTER_URL.format(ns=namespace)
    converge(plane, namespace, MD, config=ALLOWED)
    assert model_deployment(plane, namespace, MD)["status"]["endpoint"] == cluster_url
    metrics = _get(plane, kinds.SERVICE, namespace, "tiny-gateway-metrics")
    assert metrics is not None and metrics["spec"]["type"] == "ClusterIP"
    assert [p["name"] for p in metrics["spec"]["ports"]] == ["metrics"]

    # A LoadBalancer: the client Service changes type and carries the API port only (never the metrics).
    _set_exposure(
        plane,
        namespace,
        {"service": {"type": "LoadBalancer", "annotations": {"lb.example.com/internal": "no"}}},
    )
    converge(plane, namespace, MD, config=ALLOWED)
    client = _get(plane, kinds.SERVICE, namespace, "tiny-gateway")
    assert client is not None and client["spec"]["type"] == "LoadBalancer"
    assert [(p["name"], p["port"]) for p in client["spec"]["ports"]] == [("http", 8080)]
    assert client["spec"]["ports"][0]["nodePort"] > 0  # allocated by the API server
    assert client["metadata"]["annotations"]["lb.example.com/internal"] == "no"
    # No address assigned yet.
    assert model_deployment(plane, namespace, MD)["status"]["endpoint"] == cluster_url

    # The cloud's load balancer controller publishes an address (simulated here: no cloud runs).
    status, body = plane.request(
        "PATCH",
        kinds.SERVICE.path(namespace, "tiny-gateway") + "/status",
        {"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}}},
        content_type="application/merge-patch+json",
    )
    assert status == 200, body
    # The Service is a watched child: its event triggers this reconcile.
    converge(plane, namespace, MD, config=ALLOWED)
    assert model_deployment(plane, namespace, MD)["status"]["endpoint"] == "http://203.0.113.10:8080/v1"
    tenant = get(plane, f"{API}/namespaces/{namespace}/tenants/basic-a")
    assert tenant["status"]["endpoint"] == "http://203.0.113.10:8080/v1"  # what the tenant is told to call

    # An Ingress with TLS from a Secret: its host is the endpoint, https.
    ingress_spec = {
        "host": "llm.example.com",
        "className": "nginx",
        "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
        "tls": {"secretName": "llm-example-tls"},
    }
    _set_exposure(plane, namespace, {"service": {"type": "LoadBalancer"}, "ingress": ingress_spec})
    converge(plane, namespace, MD, config=ALLOWED)
    ingress = _get(plane, kinds.INGRESS, namespace, "tiny-gateway")
    assert ingress is not None
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-example-tls"}]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/v1", "Prefix")
    assert path["backend"] == {"service": {"name": "tiny-gateway", "port": {"number": 8080}}}
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert ingress["metadata"]["ownerReferences"][0]["name"] == MD  # goes with the ModelDeployment
    assert model_deployment(plane, namespace, MD)["status"]["endpoint"] == "https://llm.example.com/v1"

    # Back to the default: the Ingress is pruned, the Service is ClusterIP again, the endpoint in-cluster.
    _set_exposure(plane, namespace, {})
    converge(plane, namespace, MD, config=ALLOWED)
    assert _get(plane, kinds.INGRESS, namespace, "tiny-gateway") is None
    client = _get(plane, kinds.SERVICE, namespace, "tiny-gateway")
    assert client is not None and client["spec"]["type"] == "ClusterIP"
    assert "nodePort" not in client["spec"]["ports"][0]
    assert model_deployment(plane, namespace, MD)["status"]["endpoint"] == cluster_url


def test_without_the_charts_rights_a_condition_says_so(api_cluster: ControlPlane, namespace: str) -> None:
    """rbac.ingress off (the default): no Ingress, the ModelDeployment says why and serves in the cluster."""
    plane = api_cluster
    _set_exposure(plane, namespace, {"ingress": {"host": "llm.example.com"}})
    degraded = _degraded_by_exposure(plane, namespace, CONFIG)
    assert (
        "spec.gateway.exposure.ingress" in degraded["message"] and "rbac.ingress=true" in degraded["message"]
    )
    md = model_deployment(plane, namespace, MD)
    assert condition(md)["status"] == "True", md["status"]  # still serving in the cluster
    assert model_deployment(plane, namespace, MD)["status"]["endpoint"] == CLUSTER_URL.format(ns=namespace)
    status, body = plane.request("GET", kinds.INGRESS.path(namespace))
    assert status == 200 and body["items"] == []
    converge(plane, namespace, MD, config=CONFIG)  # and it does not keep writing


def _httproute_crd() -> dict[str, Any]:
    path = cache_dir() / "gateway-api" / "gateway.networking.k8s.io_httproutes.yaml"
    if not path.is_file():
        missing_component("Gateway API CRDs", BUILD_COMMAND)
    doc: dict[str, Any] = yaml.safe_load(Path(path).read_text())
    return doc


def _route_api_served(plane: ControlPlane, namespace: str) -> bool:
    return plane.request("GET", kinds.HTTP_ROUTE.path(namespace))[0] == 200


def test_http_route_with_and_without_the_gateway_api(api_cluster: ControlPlane, namespace: str) -> None:
    plane = api_cluster
    crd = _httproute_crd()
    # Without the Gateway API CRDs (as on most clusters): a condition, not a crash.
    plane.request("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{HTTPROUTE_CRD}")
    wait_for(lambda: not _route_api_served(plane, namespace), timeout=60, what="HTTPRoute API gone")
    route = {
        "parentRefs": [{"name": "edge", "namespace": "gateways", "sectionName": "https"}],
        "hostnames": ["llm.example.com"],
    }
    _set_exposure(plane, namespace, {"httpRoute": route})
    degraded = _degraded_by_exposure(plane, namespace, ALLOWED)
    assert "does not serve gateway.networking.k8s.io/v1" in degraded["message"], degraded
    assert model_deployment(plane, namespace, MD)["status"]["endpoint"] == CLUSTER_URL.format(ns=namespace)
    converge(plane, namespace, MD, config=ALLOWED)

    # The real CRD, installed: the next reconcile creates the route, and the endpoint is its hostname.
    status, body = plane.request(
        "PATCH",
        f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{HTTPROUTE_CRD}?fieldManager=kvfleet-tests",
        crd,
        content_type="application/apply-patch+yaml",
    )
    assert status in (200, 201), body
    try:
        wait_for(lambda: _route_api_served(plane, namespace), timeout=60, what="HTTPRoute API served")
        workloads_ready(plane, namespace, MD)
        converge(plane, namespace, MD, config=ALLOWED)
        live = _get(plane, kinds.HTTP_ROUTE, namespace, "tiny-gateway")
        assert live is not None
        assert live["spec"]["hostnames"] == ["llm.example.com"]
        (parent,) = live["spec"]["parentRefs"]
        assert {k: parent[k] for k in ("name", "namespace", "sectionName")} == route["parentRefs"][0]
        (rule,) = live["spec"]["rules"]
        assert rule["matches"][0]["path"] == {"type": "PathPrefix", "value": "/v1"}
        (backend,) = rule["backendRefs"]
        assert (backend["name"], backend["port"], backend.get("kind", "Service")) == (
            "tiny-gateway",
            8080,
            "Service",
        )
        md = model_deployment(plane, namespace, MD)
        assert md["status"]["endpoint"] == "https://llm.example.com/v1"
        assert condition(md, "Degraded")["reason"] != reasons.EXPOSURE_UNAVAILABLE

        # Removed from the spec: the route goes with it.
        _set_exposure(plane, namespace, {})
        converge(plane, namespace, MD, config=ALLOWED)
        assert _get(plane, kinds.HTTP_ROUTE, namespace, "tiny-gateway") is None
    finally:
        plane.request("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{HTTPROUTE_CRD}")


def test_the_charts_rbac_ingress_switch_lets_its_operator_create_the_ingress(
    api_cluster: ControlPlane, tmp_path: Path
) -> None:
    """Least privilege end to end: the chart installed with rbac.ingress=true, and its operator run with
    the chart's ServiceAccount identity and environment (``KVFLEET_EXPOSURE_KINDS``) creates the Ingress;
    HTTPRoutes, not enabled, stay out of its reach."""
    plane, release = api_cluster, "kvfleet-exposure"
    apply_crds(plane)
    release_ns = create_namespace(plane, "kvfleet-exposure")
    ns = create_namespace(plane, "llm-exposure")
    operator: ChartOperator | None = None
    try:
        done = helm(
            plane, "install", release, str(CHART), "-n", release_ns,
            "--set", f"operator.watchNamespaces={{{ns}}}",
            "--set", "rbac.ingress=true",
            "--set", "guardrails.hosts={llm.example.com}",
            "--set", "guardrails.requireUserRights=false",  # no cluster-wide policy for this test
            "--set", "crds.install=false",  # the session's CRDs, owned by no release
            "--set", "dedicatedGpuGroups.admissionPolicy=false",  # no cluster-wide policy for this test
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        deployment = get(plane, f"/apis/apps/v1/namespaces/{release_ns}/deployments/{release}")
        env = {
            e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env["KVFLEET_EXPOSURE_KINDS"] == "Ingress"

        md = load_example("local/modeldeployment-tiny.yaml", ns)
        md["spec"]["gateway"]["exposure"] = {"ingress": {"host": "llm.example.com"}}
        create(plane, md)
        sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        kubeconfig = plane.service_account_kubeconfig(release_ns, sa, tmp_path / "sa.kubeconfig")
        operator = ChartOperator(plane, deployment, kubeconfig, tmp_path / "operator.log")

        def ingress_and_endpoint() -> bool:
            assert operator is not None and operator.proc.poll() is None, (
                operator and operator.log.read_text()
            )
            live = _get(plane, kinds.INGRESS, ns, "tiny-gateway")
            return (
                live is not None
                and model_deployment(plane, ns, MD).get("status", {}).get("endpoint")
                == "http://llm.example.com/v1"
            )

        wait_for(ingress_and_endpoint, timeout=120, interval=1, what="the chart's operator's Ingress")
        log = operator.log.read_text()
        assert not permission_error(log), log[-4000:]
        user = f"system:serviceaccount:{release_ns}:{sa}"
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user,
                "groups": ["system:serviceaccounts", "system:authenticated"],
                "resourceAttributes": {
                    "verb": "create",
                    "resource": "httproutes",
                    "group": "gateway.networking.k8s.io",
                    "namespace": ns,
                },
            },
        }  # fmt: skip
        status, body = plane.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
        assert status == 201 and body["status"]["allowed"] is False, body
    finally:
        if operator is not None:
            operator.stop()
        helm(plane, "uninstall", release, "-n", release_ns)
        for namespace in (ns, release_ns):
            delete_namespace(plane, namespace)
