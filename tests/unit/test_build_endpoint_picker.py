"""kvfleet behind a Gateway API Inference Extension gateway, and Envoy as kvfleet's second data plane
(``spec.gateway.inferencePool``, ``spec.gateway.dataPlane``): the Endpoint Picker's Deployment, Service,
PodDisruptionBudget, NetworkPolicy and ServiceMonitor, the InferencePool of each pool, the HTTPRoute's
backend, the Envoy gateway pods, the guardrail on the platform gateway's namespace and the condition when
InferencePools cannot be created. Pure: the real builders on the qwen72b example with a dedicated tenant.

Who reaches what through the rendered NetworkPolicies is attacked in
tests/security/test_inference_pool_reachability.py; the InferencePool goes to the real API server with
GIE's own CRD in tests/cluster/test_inference_pool.py."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from test_crds_cel import admit

from gie_builders import BANK, GATEWAY_PODS, IMAGES, NS, SHARED, example, model_deployment, render
from kvfleet_operator.build.common import (
    ENGINE_PORT,
    ENVOY_ADMIN_PORT,
    EPP_METRICS_PORT,
    EPP_PORT,
    GATEWAY_PORT,
    PLUGIN_METRICS_PORT,
    selector_labels,
)
from kvfleet_operator.build.endpoint_picker import EXT_PROC_SERVICE, H2C_APP_PROTOCOL, runs_endpoint_picker
from kvfleet_operator.build.guardrails import Guardrails, check_model_deployment
from kvfleet_operator.k8s import kinds
from kvfleet_operator.reconcile import steps
from kvfleet_operator.reconcile.status import WorkloadReadiness, front_door_readiness
from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.gateway.envoy import EnvoyPorts, bootstrap
from kvfleet_runtime.gateway.epp_cli import run_envoy, run_epp
from kvfleet_runtime.gateway.settings import from_flags

PLATFORM_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}},
    "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "edge"}},
}
EPP_PODS = {"podSelector": {"matchLabels": selector_labels("qwen72b", "epp")}}
ROUTE = {"parentRefs": [{"name": "edge", "namespace": "gateways"}], "hostnames": ["llm.example.com"]}


def one(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return found


def names(children: list[dict[str, Any]], kind: str) -> set[str]:
    return {c["metadata"]["name"] for c in children if c["kind"] == kind}


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return dict(only)


def settings_flags(command: list[str]) -> list[str]:
    """A front door's command without the program, the sub-command and the per-door flags."""
    out, skip = [], False
    for arg in command[2:]:
        if skip:
            skip = False
            continue
        if arg in ("--listen", "--metrics-listen", "--epp", "--admin-port"):
            skip = True
            continue
        out.append(arg)
    return out


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# --- when the Endpoint Picker runs --------------------------------------------------------------------


def test_by_default_nothing_new_is_rendered() -> None:
    """Regression: without dataPlane or inferencePool the ModelDeployment gets what it always got."""
    children = render()
    assert not names(children, "InferencePool")
    assert not any("epp" in c["metadata"]["name"] for c in children)
    gateway = container(one(children, "Deployment", "qwen72b-gateway"))
    assert gateway["command"][:2] == ["kvfleet", "gateway"]
    assert "qwen72b-gateway-metrics" in names(children, "Service")


@pytest.mark.parametrize(
    "gateway",
    [
        pytest.param({"dataPlane": "envoy"}, id="envoy"),
        pytest.param({"inferencePool": {"gatewayPods": GATEWAY_PODS}}, id="inference-pool"),
        pytest.param({"inferencePool": {"gatewayPods": GATEWAY_PODS}, "dataPlane": "envoy"}, id="both"),
    ],
)
def test_the_endpoint_picker_runs_when_something_calls_it(gateway: dict[str, Any]) -> None:
    children = render(**gateway)
    for kind in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor"):
        assert "qwen72b-epp" in names(children, kind), kind


def test_the_endpoint_picker_runs_for_an_inference_pool_the_cluster_does_not_serve_yet() -> None:
    """Ready when the CRD arrives; but nothing admits the platform gateway until then."""
    children = render(served=False, inferencePool={"gatewayPods": GATEWAY_PODS})
    assert "qwen72b-epp" in names(children, "Deployment")
    epp_policy = one(children, "NetworkPolicy", "qwen72b-epp")
    assert [r["ports"] for r in epp_policy["spec"]["ingress"]] == [
        [{"protocol": "TCP", "port": EPP_METRICS_PORT}]
    ]


# --- the Endpoint Picker's pods ---------------------------------------------------------------------


def test_the_endpoint_pickers_pods_run_kvfleet_epp_with_the_gateways_settings_and_mounts() -> None:
    children = render(inferencePool={"gatewayPods": GATEWAY_PODS}, queueTimeout="20s", fairQueuing="fifo")
    gateway_deployment = one(children, "Deployment", "qwen72b-gateway")
    epp_deployment = one(children, "Deployment", "qwen72b-epp")
    gateway, epp = container(gateway_deployment), container(epp_deployment)
    assert epp["command"][:2] == ["kvfleet", "epp"]
    # One set of settings for both doors: tenant table, keys, replicas, drain, fair queuing, timeouts.
    assert settings_flags(epp["command"]) == settings_flags(gateway["command"])
    assert flag(epp["command"], "--queue-timeout") == "20"
    assert flag(epp["command"], "--listen") == f"0.0.0.0:{EPP_PORT}"
    assert flag(epp["command"], "--metrics-listen") == f"0.0.0.0:{EPP_METRICS_PORT}"
    assert {(p["name"], p["containerPort"]) for p in epp["ports"]} == {
        ("grpc", EPP_PORT),
        ("metrics", EPP_METRICS_PORT),
    }
    assert epp["volumeMounts"] == gateway["volumeMounts"]
    assert epp["securityContext"] == gateway["securityContext"]
    assert epp["securityContext"]["readOnlyRootFilesystem"] is True
    assert epp["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert epp["resources"] == gateway["resources"]
    # Readiness through gRPC health on the ext_proc port, as the kubelet's grpc probe asks it.
    assert epp["readinessProbe"]["grpc"] == {"port": EPP_PORT, "service": EXT_PROC_SERVICE}
    assert epp["livenessProbe"]["grpc"]["port"] == EPP_PORT
    pod, gateway_pod = (
        epp_deployment["spec"]["template"]["spec"],
        gateway_deployment["spec"]["template"]["spec"],
    )
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    assert pod["securityContext"] == gateway_pod["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["volumes"] == gateway_pod["volumes"]
    assert epp_deployment["spec"]["replicas"] == gateway_deployment["spec"]["replicas"] == 2
    labels = epp_deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "epp"
    assert epp_deployment["spec"]["selector"]["matchLabels"] == selector_labels("qwen72b", "epp")
    # Its own component: the gateway's Services, policies and PDB do not select its pods.
    assert selector_labels("qwen72b", "gateway").items() - labels.items()


def test_the_endpoint_pickers_service_is_cluster_internal_grpc_and_metrics() -> None:
    service = one(render(dataPlane="envoy"), "Service", "qwen72b-epp")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == selector_labels("qwen72b", "epp")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc", "metrics"}
    assert (ports["grpc"]["port"], ports["grpc"]["targetPort"]) == (EPP_PORT, "grpc")
    assert ports["grpc"]["appProtocol"] == H2C_APP_PROTOCOL == "kubernetes.io/h2c"
    assert (ports["metrics"]["port"], ports["metrics"]["targetPort"]) == (EPP_METRICS_PORT, "metrics")


def test_the_endpoint_pickers_metrics_are_scraped_on_the_metrics_port_only() -> None:
    children = render(inferencePool={"gatewayPods": GATEWAY_PODS})
    monitor = one(children, "ServiceMonitor", "qwen72b-epp")
    assert monitor["spec"]["selector"]["matchLabels"] == selector_labels("qwen72b", "epp")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    # Without the monitoring API, no monitor.
    assert "ServiceMonitor" not in {c["kind"] for c in render(monitoring=False, dataPlane="envoy")}


# --- Envoy as the gateway's data plane ----------------------------------------------------------------


def test_the_envoy_data_plane_runs_envoy_against_this_model_deployments_picker() -> None:
    children = render(dataPlane="envoy", queueTimeout="20s")
    deployment = one(children, "Deployment", "qwen72b-gateway")
    envoy, epp = container(deployment), container(one(children, "Deployment", "qwen72b-epp"))
    command = envoy["command"]
    assert command[:2] == ["kvfleet", "envoy"]
    assert flag(command, "--epp") == f"qwen72b-epp.{NS}.svc:{EPP_PORT}"
    assert flag(command, "--listen") == f"0.0.0.0:{GATEWAY_PORT}"
    assert flag(command, "--admin-port") == str(ENVOY_ADMIN_PORT)
    assert settings_flags(command) == settings_flags(epp["command"])
    # The API port only: the admin port is Envoy's loopback, the metrics are the picker's.
    assert [(p["name"], p["containerPort"]) for p in envoy["ports"]] == [("http", GATEWAY_PORT)]
    assert envoy["readinessProbe"]["tcpSocket"] == {"port": "http"}
    assert envoy["livenessProbe"]["tcpSocket"] == {"port": "http"}
    assert envoy["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    # Same Deployment, Service and labels as kvfleet's gateway: clients see no difference.
    kvfleet_children = render()
    assert one(children, "Service", "qwen72b-gateway") == one(kvfleet_children, "Service", "qwen72b-gateway")
    assert (
        deployment["spec"]["selector"]
        == one(kvfleet_children, "Deployment", "qwen72b-gateway")["spec"]["selector"]
    )
    # Envoy serves no metrics port: no metrics Service or ServiceMonitor that would scrape nothing.
    assert "qwen72b-gateway-metrics" not in names(children, "Service")
    assert "qwen72b-gateway" not in names(children, "ServiceMonitor")
    assert not names(children, "InferencePool")


# --- InferencePools -------------------------------------------------------------------------------


def test_one_inference_pool_per_pool_selecting_its_engines_with_this_picker_fail_close() -> None:
    children = render(inferencePool={"gatewayPods": GATEWAY_PODS})
    assert names(children, "InferencePool") == {SHARED, BANK}
    for name in (SHARED, BANK):
        pool = one(children, "InferencePool", name)
        assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
        statefulset = one(children, "StatefulSet", name)
        service, policy = one(children, "Service", name), one(children, "NetworkPolicy", name)
        selector = pool["spec"]["selector"]["matchLabels"]
        # The labels the pool's Service and NetworkPolicy use, and its pods carry; nothing else's.
        assert selector == service["spec"]["selector"] == policy["spec"]["podSelector"]["matchLabels"]
        assert selector.items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
        assert pool["spec"]["targetPorts"] == [{"number": ENGINE_PORT}]
        assert pool["spec"]["endpointPickerRef"] == {
            "kind": "Service",
            "name": "qwen72b-epp",
            "port": {"number": EPP_PORT},
            "failureMode": "FailClose",
        }
        # It goes with its pool: the dedicated pool's with its Tenant.
        assert pool["metadata"]["ownerReferences"] == statefulset["metadata"]["ownerReferences"]
    bank = one(children, "InferencePool", BANK)
    assert bank["metadata"]["ownerReferences"][0]["kind"] == "Tenant"
    other = one(children, "InferencePool", SHARED)["spec"]["selector"]["matchLabels"]
    assert bank["spec"]["selector"]["matchLabels"] != other


def test_each_inference_pool_passes_gies_own_schema_rules() -> None:
    """The fields GIE's CRD requires, its enums and its CEL rules, checked here without a cluster (the
    real API server checks the same in tests/cluster/test_inference_pool.py)."""
    for pool in (
        c for c in render(inferencePool={"gatewayPods": GATEWAY_PODS}) if c["kind"] == "InferencePool"
    ):
        spec = pool["spec"]
        assert {"selector", "targetPorts", "endpointPickerRef"} <= spec.keys()
        assert 1 <= len(spec["selector"]["matchLabels"]) <= 64
        ref = spec["endpointPickerRef"]
        assert ref["failureMode"] in ("FailOpen", "FailClose")
        assert ref["kind"] != "Service" or "port" in ref  # GIE's rule: a Service needs a port


# --- the HTTPRoute --------------------------------------------------------------------------------


def test_the_route_goes_to_the_shared_pools_inference_pool() -> None:
    exposure = {"httpRoute": ROUTE}
    children = render(inferencePool={"gatewayPods": GATEWAY_PODS}, exposure=exposure)
    (rule,) = one(children, "HTTPRoute", "qwen72b-gateway")["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": SHARED}
    ]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]


@pytest.mark.parametrize("served", [True, False])
def test_without_a_served_inference_pool_the_route_goes_to_the_gateway_service(served: bool) -> None:
    gateway: dict[str, Any] = {"exposure": {"httpRoute": ROUTE}}
    if not served:
        gateway["inferencePool"] = {"gatewayPods": GATEWAY_PODS}
    (rule,) = one(render(served=served, **gateway), "HTTPRoute", "qwen72b-gateway")["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": "qwen72b-gateway", "port": GATEWAY_PORT}]


# --- NetworkPolicies --------------------------------------------------------------------------------


def _from(policy: dict[str, Any], port: int) -> list[dict[str, Any]]:
    return [
        peer
        for rule in policy["spec"]["ingress"]
        if {"protocol": "TCP", "port": port} in rule["ports"]
        for peer in rule["from"]
    ]


def test_the_platform_gateway_is_admitted_to_the_engines_api_port_and_the_picker_only() -> None:
    children = render(inferencePool={"gatewayPods": GATEWAY_PODS})
    own_gateway = {"podSelector": {"matchLabels": selector_labels("qwen72b", "gateway")}}
    for name in (SHARED, BANK):
        policy = one(children, "NetworkPolicy", name)
        # The picker too: it checks each replica's /health on that port.
        assert _from(policy, ENGINE_PORT) == [own_gateway, EPP_PODS, PLATFORM_PEER]
        assert PLATFORM_PEER not in [
            p
            for r in policy["spec"]["ingress"]
            for p in r["from"]
            if ENGINE_PORT not in [x["port"] for x in r["ports"]]
        ]
    epp = one(children, "NetworkPolicy", "qwen72b-epp")
    assert epp["spec"]["podSelector"]["matchLabels"] == selector_labels("qwen72b", "epp")
    assert epp["spec"]["policyTypes"] == ["Ingress"]
    # kvfleet's own gateway does not call the picker (dataPlane kvfleet): the platform gateway only.
    assert _from(epp, EPP_PORT) == [PLATFORM_PEER]
    assert {p["port"] for r in epp["spec"]["ingress"] for p in r["ports"]} == {EPP_PORT, EPP_METRICS_PORT}
    assert all(r["from"] for r in epp["spec"]["ingress"])  # never an empty "from": that admits everyone
    # The gateway's own policy is unchanged.
    assert one(children, "NetworkPolicy", "qwen72b-gateway") == one(
        render(), "NetworkPolicy", "qwen72b-gateway"
    )


def test_with_envoy_only_this_model_deployments_gateway_reaches_the_picker() -> None:
    children = render(dataPlane="envoy")
    epp = one(children, "NetworkPolicy", "qwen72b-epp")
    assert _from(epp, EPP_PORT) == [{"podSelector": {"matchLabels": selector_labels("qwen72b", "gateway")}}]
    # Nothing new on the engines but the picker's health checks on the OpenAI port.
    for name in (SHARED, BANK):
        policy, before = one(children, "NetworkPolicy", name), one(render(), "NetworkPolicy", name)
        assert _from(policy, ENGINE_PORT) == [*_from(before, ENGINE_PORT), EPP_PODS]
        assert _from(policy, PLUGIN_METRICS_PORT) == _from(before, PLUGIN_METRICS_PORT)
        assert len(policy["spec"]["ingress"]) == len(before["spec"]["ingress"])


def test_the_gateway_pods_default_to_the_model_deployments_namespace() -> None:
    children = render(inferencePool={"gatewayPods": {"matchLabels": {"app": "edge"}}})
    assert _from(one(children, "NetworkPolicy", "qwen72b-epp"), EPP_PORT) == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
            "podSelector": {"matchLabels": {"app": "edge"}},
        }
    ]


# --- guardrails and the condition -------------------------------------------------------------------


def test_the_platform_gateways_namespace_must_be_one_the_platform_allows() -> None:
    md = model_deployment(inferencePool={"gatewayPods": GATEWAY_PODS})
    (refusal,) = check_model_deployment(md, Guardrails(), IMAGES)
    assert refusal.field == "spec.gateway.inferencePool.gatewayPods.namespace"
    assert "gateways is not allowed" in refusal.message
    assert "guardrails.inferenceGatewayNamespaces" in refusal.message
    assert check_model_deployment(md, Guardrails(inference_gateway_namespaces=("gate*",)), IMAGES) == []
    # The default allows the ModelDeployment's own namespace, and nothing else.
    own = model_deployment(inferencePool={"gatewayPods": {"matchLabels": {"app": "edge"}}})
    assert check_model_deployment(own, Guardrails(), IMAGES) == []


@pytest.mark.parametrize(
    ("managed", "unserved", "why"),
    [
        pytest.param(kinds.EXPOSURE_KINDS, (), None, id="managed-and-served"),
        pytest.param(
            (kinds.INGRESS, kinds.HTTP_ROUTE),
            (),
            "install the chart with rbac.inferencePool=true",
            id="no-rbac",
        ),
        pytest.param(
            kinds.EXPOSURE_KINDS,
            (kinds.INFERENCE_POOL,),
            "does not serve inference.networking.k8s.io/v1: install the Gateway API Inference Extension's "
            "InferencePool CRD",
            id="no-crd",
        ),
    ],
)
def test_inference_pools_the_operator_cannot_create_are_left_out_and_said_why(
    managed: tuple[kinds.Kind, ...], unserved: tuple[kinds.Kind, ...], why: str | None
) -> None:
    children = render(inferencePool={"gatewayPods": GATEWAY_PODS}, exposure={"httpRoute": ROUTE})
    kept, withheld = steps.withhold_exposure(children, managed, unserved)
    if why is None:
        assert withheld == {}
        assert names(kept, "InferencePool") == {SHARED, BANK}
        return
    assert set(withheld) == {"InferencePool"}
    assert why in withheld["InferencePool"]
    assert "spec.gateway.inferencePool" in withheld["InferencePool"]
    assert "an HTTPRoute goes to the gateway Service" in withheld["InferencePool"]
    assert not names(kept, "InferencePool")
    # Everything else stays, the route and the picker included.
    assert [c for c in children if c["kind"] != "InferencePool"] == kept


def test_the_crd_admits_the_fields_and_refuses_a_bad_label_key() -> None:
    doc = example("modeldeployment-qwen72b.yaml")
    doc["spec"]["gateway"] = {
        "dataPlane": "envoy",
        "inferencePool": {"gatewayPods": copy.deepcopy(GATEWAY_PODS)},
    }
    assert admit("ModelDeployment", doc) == []
    doc["spec"]["gateway"]["inferencePool"]["gatewayPods"]["matchLabels"] = {"no spaces": "x"}
    ((_, message),) = admit("ModelDeployment", doc)
    assert "spec.gateway.inferencePool.gatewayPods.matchLabels" in message
    with pytest.raises(ValueError, match=r"gatewayPods\.matchLabels"):
        model_deployment(inferencePool={"gatewayPods": {"matchLabels": {"no spaces": "x"}}})
    assert model_deployment().spec.gateway.data_plane.value == "kvfleet"


def _live(name: str, ready: int) -> dict[str, Any]:
    return {"kind": "Deployment", "metadata": {"name": name}, "status": {"readyReplicas": ready}}


@pytest.mark.parametrize(
    ("gateway", "ready"),
    [
        pytest.param({}, 2, id="kvfleet: the gateway alone"),
        pytest.param({"dataPlane": "envoy"}, 1, id="envoy: needs its picker"),
        pytest.param({"inferencePool": {"gatewayPods": GATEWAY_PODS}}, 1, id="inference-pool"),
    ],
)
def test_a_gateway_replica_serves_only_with_a_picker_replica_beside_it(
    gateway: dict[str, Any], ready: int
) -> None:
    """Ready must not say the front door serves while the picker every request goes through is down."""
    md = model_deployment(**gateway)
    children = [_live("qwen72b-gateway", 2), _live("qwen72b-epp", 1)]
    assert front_door_readiness(md, children) == WorkloadReadiness(wanted=2, ready=ready)
    assert runs_endpoint_picker(md) == (ready == 1)


# --- TLS on the picker's port ---------------------------------------------------------------------


def _volume(workload: dict[str, Any], name: str) -> dict[str, Any] | None:
    found = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return found[0] if found else None


def test_with_a_tls_secret_the_picker_serves_tls_and_envoy_verifies_it_with_the_ca_only() -> None:
    children = render(
        dataPlane="envoy",
        inferencePool={"gatewayPods": GATEWAY_PODS},
        endpointPicker={"tlsSecretName": "epp-tls"},
    )
    epp_deployment = one(children, "Deployment", "qwen72b-epp")
    epp = container(epp_deployment)
    assert flag(epp["command"], "--tls-cert") == "/etc/kvfleet/epp-tls/tls.crt"
    assert flag(epp["command"], "--tls-key") == "/etc/kvfleet/epp-tls/tls.key"
    assert _volume(epp_deployment, "epp-tls") == {
        "name": "epp-tls",
        "secret": {
            "secretName": "epp-tls",
            "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
        },
    }
    assert {"name": "epp-tls", "mountPath": "/etc/kvfleet/epp-tls", "readOnly": True} in epp["volumeMounts"]
    # The kubelet's grpc probe speaks no TLS: a TCP probe on the gRPC port instead.
    assert epp["readinessProbe"]["tcpSocket"] == {"port": "grpc"}
    assert "grpc" not in epp["readinessProbe"] and "grpc" not in epp["livenessProbe"]
    # No h2c claim on a TLS port.
    (grpc,) = [p for p in one(children, "Service", "qwen72b-epp")["spec"]["ports"] if p["name"] == "grpc"]
    assert "appProtocol" not in grpc
    # Envoy gets the CA it verifies the picker with, and never the picker's key.
    gateway_deployment = one(children, "Deployment", "qwen72b-gateway")
    envoy = container(gateway_deployment)
    assert flag(envoy["command"], "--epp-ca") == "/etc/kvfleet/epp-tls/ca.crt"
    volume = _volume(gateway_deployment, "epp-tls")
    assert volume is not None
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_without_a_tls_secret_nothing_mounts_one() -> None:
    children = render(dataPlane="envoy", inferencePool={"gatewayPods": GATEWAY_PODS})
    for name in ("qwen72b-epp", "qwen72b-gateway"):
        deployment = one(children, "Deployment", name)
        assert _volume(deployment, "epp-tls") is None
        command = container(deployment)["command"]
        assert not {"--tls-cert", "--tls-key", "--epp-ca"} & set(command)
    # kvfleet's own gateway never mounts the picker's Secret, TLS or not.
    kvfleet = render(inferencePool={"gatewayPods": GATEWAY_PODS}, endpointPicker={"tlsSecretName": "epp-tls"})
    assert _volume(one(kvfleet, "Deployment", "qwen72b-gateway"), "epp-tls") is None


# --- the commands as the runtime parses them ----------------------------------------------------------


def test_the_rendered_commands_are_what_kvfleet_epp_and_kvfleet_envoy_accept() -> None:
    """The operator writes the flags, the runtime reads them: both commands parse with the real ``kvfleet``
    parser, to the ports, the picker's address, TLS files and settings the pods need; and the Envoy
    configuration renders from the Envoy pods' own command (``kvfleet envoy --print-config``'s path)."""
    children = render(
        dataPlane="envoy",
        inferencePool={"gatewayPods": GATEWAY_PODS},
        endpointPicker={"tlsSecretName": "epp-tls"},
        queueTimeout="20s",
    )
    parser = build_parser()
    epp = parser.parse_args(container(one(children, "Deployment", "qwen72b-epp"))["command"][1:])
    assert epp.func is run_epp
    assert (epp.listen, epp.metrics_listen) == (("0.0.0.0", EPP_PORT), ("0.0.0.0", EPP_METRICS_PORT))
    assert (str(epp.tls_cert), str(epp.tls_key)) == (
        "/etc/kvfleet/epp-tls/tls.crt",
        "/etc/kvfleet/epp-tls/tls.key",
    )
    envoy = parser.parse_args(container(one(children, "Deployment", "qwen72b-gateway"))["command"][1:])
    assert envoy.func is run_envoy
    assert envoy.epp == (f"qwen72b-epp.{NS}.svc", EPP_PORT)
    assert envoy.listen == ("0.0.0.0", GATEWAY_PORT)
    assert envoy.admin_port == ENVOY_ADMIN_PORT
    assert str(envoy.epp_ca) == "/etc/kvfleet/epp-tls/ca.crt"
    settings = from_flags(envoy)
    assert settings == from_flags(epp)  # one set of settings for both halves of the front door
    assert settings.max_queue_wait_s == 20
    assert str(settings.config_path) == "/etc/kvfleet/config/tenants.json"
    config = bootstrap(
        settings, EnvoyPorts("0.0.0.0", GATEWAY_PORT, ENVOY_ADMIN_PORT, *envoy.epp), envoy.epp_ca
    )
    assert f"qwen72b-epp.{NS}.svc" in json.dumps(config)
