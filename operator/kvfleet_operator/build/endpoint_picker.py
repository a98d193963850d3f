"""kvfleet behind a Gateway API Inference Extension (GIE) gateway: the Endpoint Picker (EPP) and an
InferencePool per engine pool. Pure.

The EPP (``kvfleet epp``, ``kvfleet_runtime.gateway.epp``) is an Envoy ``ext_proc`` gRPC server that runs
the gateway's request pipeline: a GIE gateway (the platform's, through an InferencePool's
``endpointPickerRef``) or kvfleet's own Envoy (``spec.gateway.dataPlane: envoy``) asks it, for each
request, which engine serves it; it authenticates the tenant, applies its limits, salts and prioritises the
request, queues it fairly and picks the replica. It runs whenever one of the two needs it
(``runs_endpoint_picker``), with the gateway's replicas, settings, mounts and pod security.

Ports: gRPC (``EPP_PORT``, ext_proc and gRPC health) and Prometheus (``EPP_METRICS_PORT``, the same
series as the gateway's, which it replaces for the Envoy data plane). Who reaches them is
``build.network.build_epp_network_policy``'s.

An InferencePool selects one pool's engine pods (the labels its Service, StatefulSet and NetworkPolicy
use) on vLLM's OpenAI port, and names the EPP's Service with ``failureMode: FailClose``: a gateway that
cannot ask the EPP refuses the request rather than route it without tenancy.
"""

from __future__ import annotations

from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.api.modeldeployment import DataPlane, GatewayPods
from kvfleet_operator.build.common import (
    ENGINE_PORT,
    EPP_COMPONENT,
    EPP_METRICS_PORT,
    EPP_PORT,
    Obj,
    Owner,
    engine_name,
    epp_name,
    metadata,
    object_labels,
    restricted_container_security,
    selector_labels,
)
from kvfleet_operator.build.gateway import (
    EPP_TLS_DIR,
    GATEWAY_PRESTOP_SLEEP_S,
    GatewayWorkload,
    build_front_door_deployment,
    build_pdb,
    epp_tls_mounts,
    epp_tls_volume,
    front_door_env,
    front_door_resources,
    gateway_settings_args,
    runtime_config_mounts,
)
from kvfleet_operator.build.network import NAMESPACE_NAME_LABEL

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
#: The gRPC service the EPP's health reports under (``kvfleet_runtime.gateway.epp.SERVICE_NAME``): the
#: kubelet's gRPC probe asks for it. Written out because the operator does not import gRPC.
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: The EPP Service's gRPC port speaks HTTP/2 without TLS (Kubernetes' standard application protocol name).
H2C_APP_PROTOCOL = "kubernetes.io/h2c"


def runs_endpoint_picker(md: ModelDeployment) -> bool:
    """Whether ``md`` has an EPP: for the Envoy data plane, or for InferencePools (also while the cluster
    does not serve them yet: the EPP is ready when the CRD arrives)."""
    return md.spec.gateway.data_plane is DataPlane.ENVOY or md.spec.gateway.inference_pool is not None


def _epp_probes(g: GatewayWorkload) -> Obj:
    """gRPC health (grpc.health.v1) on the ext_proc port, SERVING once the tenant table is loaded, as the
    kubelet's grpc probe asks it; that probe speaks no TLS, so with TLS a TCP connection to the port (the
    server accepts only once it serves)."""
    if g.epp_tls_secret is not None:
        check: Obj = {"tcpSocket": {"port": "grpc"}}
    else:
        check = {"grpc": {"port": EPP_PORT, "service": EXT_PROC_SERVICE}}
    return {"readinessProbe": {**check, "periodSeconds": 5}, "livenessProbe": {**check, "periodSeconds": 10}}


def _epp_tls_args(g: GatewayWorkload) -> list[str]:
    if g.epp_tls_secret is None:
        return []
    return ["--tls-cert", f"{EPP_TLS_DIR}/tls.crt", "--tls-key", f"{EPP_TLS_DIR}/tls.key"]


def _epp_container(g: GatewayWorkload) -> Obj:
    return {
        "name": "epp",
        "image": g.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "kvfleet",
            "epp",
            *gateway_settings_args(g),
            "--listen",
            f"0.0.0.0:{EPP_PORT}",
            "--metrics-listen",
            f"0.0.0.0:{EPP_METRICS_PORT}",
            *_epp_tls_args(g),
        ],
        "ports": [
            {"name": "grpc", "containerPort": EPP_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": front_door_resources(g),
        **_epp_probes(g),
        "lifecycle": {"preStop": {"sleep": {"seconds": GATEWAY_PRESTOP_SLEEP_S}}},
        "securityContext": restricted_container_security(),
        "volumeMounts": runtime_config_mounts() + epp_tls_mounts(g),
        **front_door_env(g),
    }


def build_epp_deployment(g: GatewayWorkload) -> Obj:
    """The EPP's pods: ``kvfleet epp`` with the gateway's settings, as many replicas as the gateway (each
    enforces 1/replicas of every tenant's rate limits, like a gateway replica)."""
    volumes = epp_tls_volume(g, ("tls.crt", "tls.key"))
    return build_front_door_deployment(
        g, EPP_COMPONENT, epp_name(g.model_deployment), _epp_container(g), volumes
    )


def build_epp_service(g: GatewayWorkload) -> Obj:
    """``<md>-epp``: the gRPC port an InferencePool's ``endpointPickerRef`` and the Envoy data plane name,
    and the metrics port the ServiceMonitor scrapes. ClusterIP only: the EPP is never exposed. The gRPC
    port says ``kubernetes.io/h2c`` (HTTP/2 without TLS) when it is plaintext; with TLS no standard name
    fits, so none."""
    grpc: Obj = {"name": "grpc", "port": EPP_PORT, "targetPort": "grpc", "protocol": "TCP"}
    if g.epp_tls_secret is None:
        grpc["appProtocol"] = H2C_APP_PROTOCOL
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            epp_name(g.model_deployment),
            g.namespace,
            object_labels(g.model_deployment, EPP_COMPONENT),
            g.owner,
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(g.model_deployment, EPP_COMPONENT),
            "ports": [
                grpc,
                {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def build_epp_pdb(g: GatewayWorkload) -> Obj:
    return build_pdb(
        namespace=g.namespace,
        model_deployment=g.model_deployment,
        component=EPP_COMPONENT,
        pool=None,
        owner=g.owner,
        name=epp_name(g.model_deployment),
    )


def build_endpoint_picker(g: GatewayWorkload) -> list[Obj]:
    """The EPP's Deployment, Service and PodDisruptionBudget (the caller decides whether one runs:
    ``runs_endpoint_picker``)."""
    return [build_epp_deployment(g), build_epp_service(g), build_epp_pdb(g)]


def build_inference_pool(namespace: str, model_deployment: str, pool: str, owner: Owner) -> Obj:
    """One pool's InferencePool (named like its engine Service): its engine pods on vLLM's OpenAI port,
    this ModelDeployment's EPP as the endpoint picker, FailClose. ``owner``: the pool's (the Tenant's for
    a dedicated pool), so it goes with the pool."""
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": metadata(
            engine_name(model_deployment, pool),
            namespace,
            object_labels(model_deployment, "engine", pool),
            owner,
        ),
        "spec": {
            "selector": {"matchLabels": selector_labels(model_deployment, "engine", pool)},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": epp_name(model_deployment),
                "port": {"number": EPP_PORT},
                "failureMode": "FailClose",
            },
        },
    }


def gateway_pods_peer(pods: GatewayPods, namespace: str) -> Obj:
    """The platform gateway's pods as one NetworkPolicy peer: its namespace by name (the label the API
    server sets, which no team can put on another namespace) AND its pods' labels. ``namespace``: the
    ModelDeployment's, when ``pods.namespace`` is empty."""
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: pods.namespace or namespace}},
        "podSelector": {"matchLabels": dict(sorted(pods.match_labels.items()))},
    }
