"""The local control plane's command lines (hack/devcluster/cluster.py) for a lost-node test: the session's
plane keeps its long grace period and kwok's Lease; a plane asked for a short grace period renews its fake
nodes' Leases often enough to keep healthy nodes Ready; pods are evicted from a tainted node as in any
cluster. And what KEDA needs of it (hack/devcluster/keda.py): the aggregation layer, the HPA controller,
its metrics API server registered where the aggregator reaches it."""

from __future__ import annotations

from pathlib import Path

import pytest
from devcluster.cluster import (
    CONTROLLERS,
    HPA_SYNC_PERIOD_S,
    NODE_MONITOR_GRACE_PERIOD_S,
    build_apiserver_args,
    build_controller_manager_args,
    build_kwok_args,
    kwok_node_lease_seconds,
)
from devcluster.keda import (
    build_adapter_args,
    build_metrics_api_objects,
    build_operator_args,
    keda_certificate_sans,
)
from devcluster.pki import FRONT_PROXY_CLIENT_CN, Pki

PKI = Pki(
    *(Path(f"/pki/{n}") for n in ("ca.crt", "ca.key", "s.crt", "s.key", "a.crt", "a.key", "sa.key", "sa.pub"))
)


def _flag(args: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")), None)


def test_the_session_plane_keeps_its_long_grace_period_and_kwoks_lease() -> None:
    kcm = build_controller_manager_args(Path("kcm"), PKI, Path("kubeconfig"), 1)
    assert _flag(kcm, "node-monitor-grace-period") == f"{NODE_MONITOR_GRACE_PERIOD_S}s" == "900s"
    assert kwok_node_lease_seconds(NODE_MONITOR_GRACE_PERIOD_S) is None
    kwok = build_kwok_args(Path("kwok"), Path("kubeconfig"), 2, [])
    assert _flag(kwok, "node-lease-duration-seconds") is None
    assert _flag(kwok, "manage-nodes-with-annotation-selector") == "kwok.x-k8s.io/node=fake"


@pytest.mark.parametrize(("grace", "lease"), [(20, 5), (12, 4), (60, 15)])
def test_a_short_grace_period_gets_leases_renewed_well_within_it(grace: int, lease: int) -> None:
    kcm = build_controller_manager_args(Path("kcm"), PKI, Path("kubeconfig"), 1, grace)
    assert _flag(kcm, "node-monitor-grace-period") == f"{grace}s"
    assert kwok_node_lease_seconds(grace) == lease
    # kwok renews at a quarter of the Lease: eight renewals or more fit in the grace period, so a few late
    # ones on a loaded machine do not make a healthy node NotReady.
    assert lease / 4 <= grace / 8
    kwok = build_kwok_args(Path("kwok"), Path("kubeconfig"), 2, [], "lost", node_lease_s=lease)
    assert _flag(kwok, "node-lease-duration-seconds") == str(lease)
    assert _flag(kwok, "manage-nodes-with-annotation-selector") == "kwok.x-k8s.io/node=lost"


def test_the_taint_eviction_controller_runs() -> None:
    """Since Kubernetes 1.29 the node lifecycle controller only taints; without this controller nothing
    evicts a pod from a lost node (a pod's tolerationSeconds would mean nothing)."""
    assert {"node-lifecycle-controller", "taint-eviction-controller"} <= set(CONTROLLERS)
    kcm = build_controller_manager_args(Path("kcm"), PKI, Path("kubeconfig"), 1)
    assert "taint-eviction-controller" in (_flag(kcm, "controllers") or "").split(",")


def test_the_api_server_proxies_aggregated_apis_with_the_front_proxy_identity() -> None:
    """KEDA's metrics API server trusts the aggregator only through these settings, and the aggregator must
    reach it at an endpoint (no kube-proxy routes a Service's cluster IP on the api and full tiers)."""
    args = build_apiserver_args(Path("kube-apiserver"), PKI, "http://etcd", 6443, Path("/certs"))
    assert _flag(args, "requestheader-client-ca-file") == "/pki/front-proxy-ca.crt"
    assert _flag(args, "proxy-client-cert-file") == "/pki/front-proxy-client.crt"
    assert _flag(args, "requestheader-allowed-names") == FRONT_PROXY_CLIENT_CN
    assert _flag(args, "enable-aggregator-routing") == "true"
    # The front proxy has its own CA: a client certificate from the cluster CA cannot claim to be it.
    assert _flag(args, "requestheader-client-ca-file") != _flag(args, "client-ca-file")


def test_the_hpa_controller_runs_and_evaluates_often() -> None:
    kcm = build_controller_manager_args(Path("kcm"), PKI, Path("kubeconfig"), 1)
    assert "horizontal-pod-autoscaler-controller" in (_flag(kcm, "controllers") or "").split(",")
    assert _flag(kcm, "horizontal-pod-autoscaler-sync-period") == f"{HPA_SYNC_PERIOD_S}s"


def test_keda_is_registered_for_external_metrics_at_a_routable_endpoint() -> None:
    service, endpoints, apiservice = build_metrics_api_objects("10.1.2.3", 40443, b"PEM")
    assert apiservice["metadata"]["name"] == "v1beta1.external.metrics.k8s.io"
    ref = apiservice["spec"]["service"]
    assert (ref["name"], ref["namespace"]) == (service["metadata"]["name"], service["metadata"]["namespace"])
    # The aggregator resolves the APIService's port to the Service port's name, then to the slice's port.
    [port] = service["spec"]["ports"]
    assert port["port"] == ref["port"] and "selector" not in service["spec"]
    assert endpoints["metadata"]["labels"]["kubernetes.io/service-name"] == service["metadata"]["name"]
    assert endpoints["ports"] == [{"name": port["name"], "port": 40443, "protocol": "TCP"}]
    assert endpoints["endpoints"][0]["addresses"] == ["10.1.2.3"]
    # The adapter's certificate names what the aggregator checks (the Service's DNS name) and the address.
    sans = keda_certificate_sans("10.1.2.3")
    assert "DNS:keda-metrics-apiserver.keda.svc" in sans and "IP:10.1.2.3" in sans
    adapter = build_adapter_args(
        Path("keda-adapter"),
        kubeconfig=Path("kc"),
        cert_dir=Path("/certs"),
        address="10.1.2.3",
        secure_port=40443,
        grpc_port=9666,
        metrics_port=9022,
    )
    assert _flag(adapter, "bind-address") == "10.1.2.3" and _flag(adapter, "secure-port") == "40443"
    assert _flag(adapter, "metrics-service-address") == "127.0.0.1:9666"
    operator = build_operator_args(
        Path("keda-operator"), cert_dir=Path("/certs"), grpc_port=9666, metrics_port=1, probe_port=2
    )
    assert _flag(operator, "metrics-service-bind-address") == "127.0.0.1:9666"
