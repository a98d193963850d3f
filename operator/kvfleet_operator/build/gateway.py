"""The tenant-aware gateway of one ModelDeployment: Deployment, Services, PodDisruptionBudgets, and the
objects that expose it outside the cluster (``spec.gateway.exposure``). Pure.

Exposure (docs/operations.md, "Exposure"): the client Service carries the OpenAI API port only, with the
type the spec asks for; the metrics port has its own ClusterIP Service, so a LoadBalancer or NodePort never
publishes the metrics (they name every tenant). An Ingress or an HTTPRoute routes the path prefix ``/v1``
(the OpenAI API) to the client Service; the health endpoints stay inside the cluster.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from dataclasses import dataclass, field

from kvfleet_operator.api.modeldeployment import (
    DataPlane,
    ExposureSpec,
    FairQueuingOrder,
    InferencePoolSpec,
    ServiceType,
)
from kvfleet_operator.build.common import (
    CONFIG_DIR,
    ENVOY_ADMIN_PORT,
    EPP_PORT,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    KEY_FILE_KEY,
    KEYS_DIR,
    KV_EVENTS_PORT,
    SHARED_POOL,
    TENANT_TABLE_KEY,
    Obj,
    Owner,
    config_map_name,
    engine_name,
    epp_name,
    gateway_name,
    keys_secret_name,
    metadata,
    object_labels,
    restricted_container_security,
    restricted_pod_security,
    selector_labels,
)
from kvfleet_operator.build.engine import build_node_loss_tolerations
from kvfleet_operator.build.gateway_store import GatewayStore, gateway_store_args, gateway_store_env

#: Seconds a gateway pod keeps serving after Kubernetes decides to stop it and before it gets SIGTERM (the
#: preStop sleep): long enough for the pod's removal from the Service's endpoints to reach every node's
#: proxy, so no new connection is sent to a gateway that has begun to drain.
GATEWAY_PRESTOP_SLEEP_S = 5
#: Seconds in-flight requests (streams included) get to finish after SIGTERM (``--drain-timeout``).
GATEWAY_DRAIN_TIMEOUT_S = 60
#: Where an InferencePool (inference.networking.k8s.io) lives, as an HTTPRoute's backendRef names it.
INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
#: The kubelet's SIGKILL comes this long after the pod starts terminating: preStop + drain + a margin for
#: the process to exit.
GATEWAY_TERMINATION_GRACE_S = GATEWAY_PRESTOP_SLEEP_S + GATEWAY_DRAIN_TIMEOUT_S + 10


@dataclass(frozen=True)
class GatewayWorkload:
    namespace: str
    model_deployment: str
    owner: Owner
    replicas: int
    image: str
    cpu_request: str = "500m"
    memory_request: str = "256Mi"
    memory_limit: str = "1Gi"
    exposure: ExposureSpec = field(default_factory=ExposureSpec)
    #: ``spec.gateway.fairQueuing``, ``.engineInFlightPerReplica`` and ``.queueTimeout`` (seconds); ``None``:
    #: not rendered, the gateway's own default.
    fair_queuing: FairQueuingOrder | None = None
    engine_in_flight_per_replica: int | None = None
    queue_timeout_s: float | None = None
    #: Hosts whose http(s) media URLs requests may carry (the chart's ``allowedMediaHosts``); empty: only
    #: ``data:`` URLs.
    allowed_media_domains: tuple[str, ...] = ()
    #: ``spec.gateway.dataPlane``: kvfleet's gateway, or Envoy asking the Endpoint Picker.
    data_plane: DataPlane = DataPlane.KVFLEET
    #: ``spec.gateway.inferencePool`` where the operator applies InferencePools (the chart grants the
    #: right and the cluster serves the CRD); ``None`` otherwise: then nothing routes to an InferencePool
    #: and no NetworkPolicy admits the platform gateway's pods.
    inference_pool: InferencePoolSpec | None = None
    #: ``spec.gateway.endpointPicker.tlsSecretName``: TLS on the picker's gRPC port; ``None``: plaintext.
    epp_tls_secret: str | None = None
    #: The store the replicas split rate limits through (the chart's ``gatewaySharedStore``); ``None``:
    #: each replica enforces 1/replicas of every limit.
    shared_store: GatewayStore | None = None
    #: ``spec.gateway.routing``: follow the engines' KV events (precise) or route by affinity only.
    precise_routing: bool = True


def gateway_engine_in_flight(engine_in_flight_per_replica: int, gateway_replicas: int) -> int:
    """What one gateway replica may give one engine replica at once (its ``--engine-in-flight-per-replica``):
    the spec's figure, which is per engine replica over all gateway replicas, split over the gateway replicas
    and rounded up (each gateway replica holds and orders its own requests). 0 stays 0: no limit."""
    if engine_in_flight_per_replica == 0:
        return 0
    return -(-engine_in_flight_per_replica // max(1, gateway_replicas))


def gateway_fair_queuing_args(g: GatewayWorkload) -> list[str]:
    """The gateway flags for what ``spec.gateway`` sets of fair queuing; nothing for what it leaves unset."""
    args: list[str] = []
    if g.fair_queuing is not None:
        args += ["--fair-queuing", g.fair_queuing.value]
    if g.engine_in_flight_per_replica is not None:
        per_gateway = gateway_engine_in_flight(g.engine_in_flight_per_replica, g.replicas)
        args += ["--engine-in-flight-per-replica", str(per_gateway)]
    if g.queue_timeout_s is not None:
        args += ["--queue-timeout", f"{g.queue_timeout_s:g}"]
    return args


def gateway_connection_args(g: GatewayWorkload) -> list[str]:
    """``--max-connections-per-source 0`` when clients may arrive through something that hides their
    addresses (an Ingress or HTTPRoute: the proxy's pods; a LoadBalancer or NodePort Service: the nodes'
    addresses after kube-proxy's SNAT), where a bound per address would be a bound on every client; the
    gateway's default (a quarter of ``--max-connections`` per address) for a ClusterIP Service only, whose
    clients are pods that keep their own addresses."""
    e = g.exposure
    proxied = (
        e.ingress is not None or e.http_route is not None or e.service.type is not ServiceType.CLUSTER_IP
    )
    return ["--max-connections-per-source", "0"] if proxied else []


def gateway_media_args(g: GatewayWorkload) -> list[str]:
    """``--allowed-media-domains`` when the platform allows media hosts (the engines get the same list);
    nothing otherwise: the gateway's default lets only ``data:`` URLs through."""
    return ["--allowed-media-domains", ",".join(g.allowed_media_domains)] if g.allowed_media_domains else []


def runtime_config_args() -> list[str]:
    """Where every front door reads the tenant table and the key file (``runtime_config_mounts``)."""
    return ["--config", f"{CONFIG_DIR}/{TENANT_TABLE_KEY}", "--keys", f"{KEYS_DIR}/{KEY_FILE_KEY}"]


def gateway_tuning_args(g: GatewayWorkload) -> list[str]:
    """The replica count (each replica enforces 1/replicas of every tenant's rate limits, unless a shared
    store splits them by demand), the drain time, what the spec and the chart set, and the engines' KV
    events port unless ``spec.gateway.routing`` is affinity."""
    return [
        "--replicas",
        str(g.replicas),
        "--drain-timeout",
        str(GATEWAY_DRAIN_TIMEOUT_S),
        *gateway_fair_queuing_args(g),
        *gateway_connection_args(g),
        *gateway_media_args(g),
        *gateway_store_args(g.shared_store),
        # Precise routing: the engines publish their KV events there (``build/engine.py``).
        *(["--kv-events-port", str(KV_EVENTS_PORT)] if g.precise_routing else []),
    ]


def gateway_settings_args(g: GatewayWorkload) -> list[str]:
    """The gateway settings every front door of ``g`` runs with (``kvfleet gateway``, ``kvfleet epp``,
    ``kvfleet envoy`` take the same flags)."""
    return [*runtime_config_args(), *gateway_tuning_args(g)]


def runtime_config_mounts() -> list[Obj]:
    """The tenant table and the key file, read only, where ``gateway_settings_args`` points."""
    return [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
    ]


def front_door_resources(g: GatewayWorkload) -> Obj:
    return {
        "requests": {"cpu": g.cpu_request, "memory": g.memory_request},
        "limits": {"memory": g.memory_limit},
    }


#: Where the picker's TLS Secret is mounted: the picker's pods get tls.crt and tls.key, the Envoy gateway's
#: pods only ca.crt.
EPP_TLS_DIR = "/etc/kvfleet/epp-tls"
EPP_TLS_VOLUME = "epp-tls"


def epp_tls_volume(g: GatewayWorkload, keys: tuple[str, ...]) -> list[Obj]:
    """The picker's TLS Secret as a volume holding only ``keys`` (none without TLS)."""
    if g.epp_tls_secret is None:
        return []
    items = [{"key": k, "path": k} for k in keys]
    return [{"name": EPP_TLS_VOLUME, "secret": {"secretName": g.epp_tls_secret, "items": items}}]


def epp_tls_mounts(g: GatewayWorkload) -> list[Obj]:
    if g.epp_tls_secret is None:
        return []
    return [{"name": EPP_TLS_VOLUME, "mountPath": EPP_TLS_DIR, "readOnly": True}]


def build_front_door_deployment(
    g: GatewayWorkload, component: str, name: str, container: Obj, volumes: list[Obj] | None = None
) -> Obj:
    """A Deployment of ``g.replicas`` pods running ``container`` with the tenant table and keys mounted,
    the ``restricted`` Pod Security level, no service-account token and no service links (the gateway's
    and the Endpoint Picker's: both hold the key hashes and the salt key)."""
    labels = object_labels(g.model_deployment, component)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, g.namespace, labels, g.owner),
        "spec": {
            "replicas": g.replicas,
            "selector": {"matchLabels": selector_labels(g.model_deployment, component)},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": GATEWAY_TERMINATION_GRACE_S,
                    "securityContext": restricted_pod_security(),
                    # Like the engines': a pod on a node that stopped reporting is evicted (and its
                    # Deployment starts another) after 30 s, not DefaultTolerationSeconds' 300 s.
                    "tolerations": build_node_loss_tolerations(()),
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": config_map_name(g.model_deployment)}},
                        {"name": "keys", "secret": {"secretName": keys_secret_name(g.model_deployment)}},
                        *(volumes or []),
                    ],
                },
            },
        },
    }


def epp_address(g: GatewayWorkload) -> str:
    """``host:port`` of this ModelDeployment's Endpoint Picker, as the Envoy data plane dials it."""
    return f"{epp_name(g.model_deployment)}.{g.namespace}.svc:{EPP_PORT}"


def _gateway_container(g: GatewayWorkload) -> Obj:
    return {
        "name": "gateway",
        "image": g.image,
        "imagePullPolicy": "IfNotPresent",
        # In the order of the releases before the Envoy data plane: the same pod template, no rollout.
        "command": [
            "kvfleet",
            "gateway",
            *runtime_config_args(),
            "--listen",
            f"0.0.0.0:{GATEWAY_PORT}",
            "--metrics-listen",
            f"0.0.0.0:{GATEWAY_METRICS_PORT}",
            *gateway_tuning_args(g),
        ],
        "ports": [
            {"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": GATEWAY_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": front_door_resources(g),
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10},
        # The sleep action needs no binary in the image (Kubernetes >= 1.30, the chart's kubeVersion).
        "lifecycle": {"preStop": {"sleep": {"seconds": GATEWAY_PRESTOP_SLEEP_S}}},
        "securityContext": restricted_container_security(),
        "volumeMounts": runtime_config_mounts(),
        **front_door_env(g),
    }


def front_door_env(g: GatewayWorkload) -> Obj:
    """The environment of a container that runs the tenancy pipeline (the gateway, the Endpoint Picker):
    the shared store's password, when there is one."""
    env = gateway_store_env(g.shared_store, g.model_deployment)
    return {"env": env} if env else {}


def _envoy_container(g: GatewayWorkload) -> Obj:
    """Envoy (``kvfleet envoy`` renders its configuration from the same settings and execs it): the API
    port only. Its metrics are the Endpoint Picker's (it runs the tenancy); its admin port is bound to the
    pod's loopback, where the kubelet cannot reach ``/ready``, so the probes open a TCP connection to the
    API port: Envoy accepts there only once its listener is up (after its initialization, which is what
    ``/ready`` reports), and Envoy's own answer to a request the Endpoint Picker cannot take is 500
    (FailClose), never a request routed without tenancy."""
    return {
        "name": "gateway",
        "image": g.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "kvfleet",
            "envoy",
            *gateway_settings_args(g),
            "--listen",
            f"0.0.0.0:{GATEWAY_PORT}",
            "--epp",
            epp_address(g),
            "--admin-port",
            str(ENVOY_ADMIN_PORT),
            # TLS to the picker, verified against the Secret's CA.
            *(["--epp-ca", f"{EPP_TLS_DIR}/ca.crt"] if g.epp_tls_secret is not None else []),
        ],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "resources": front_door_resources(g),
        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10},
        "lifecycle": {"preStop": {"sleep": {"seconds": GATEWAY_PRESTOP_SLEEP_S}}},
        "securityContext": restricted_container_security(),
        "volumeMounts": runtime_config_mounts() + epp_tls_mounts(g),
    }


def build_gateway_deployment(g: GatewayWorkload) -> Obj:
    """The gateway pods: kvfleet's gateway (``dataPlane: kvfleet``) or Envoy calling the Endpoint Picker
    (``dataPlane: envoy``); same Deployment, labels and Services either way."""
    if g.data_plane is DataPlane.ENVOY:
        envoy = _envoy_container(g)
        volumes = epp_tls_volume(g, ("ca.crt",))  # the CA only: never the picker's key
        return build_front_door_deployment(g, "gateway", gateway_name(g.model_deployment), envoy, volumes)
    return build_front_door_deployment(g, "gateway", gateway_name(g.model_deployment), _gateway_container(g))


#: The path prefix an Ingress or HTTPRoute sends to the gateway: the OpenAI API, nothing else.
EXPOSED_PATH_PREFIX = "/v1"


def gateway_metrics_service_name(model_deployment: str) -> str:
    return f"{gateway_name(model_deployment)}-metrics"


def build_gateway_service(g: GatewayWorkload) -> Obj:
    """The client Service: the API port only, of the type ``spec.gateway.exposure.service`` asks for."""
    service = g.exposure.service
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            gateway_name(g.model_deployment),
            g.namespace,
            object_labels(g.model_deployment, "gateway"),
            g.owner,
            dict(sorted(service.annotations.items())) or None,
        ),
        "spec": {
            "type": service.type.value,
            "selector": selector_labels(g.model_deployment, "gateway"),
            "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_gateway_metrics_service(g: GatewayWorkload) -> Obj:
    """The metrics port's own Service, always ClusterIP: whatever the client Service's type, the metrics
    stay in the cluster (the ServiceMonitor finds this one by its ``metrics`` port; the NetworkPolicy
    admits only the labelled scrapers to it)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            gateway_metrics_service_name(g.model_deployment),
            g.namespace,
            object_labels(g.model_deployment, "gateway"),
            g.owner,
        ),
        "spec": {
            "type": ServiceType.CLUSTER_IP.value,
            "selector": selector_labels(g.model_deployment, "gateway"),
            "ports": [
                {"name": "metrics", "port": GATEWAY_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}
            ],
        },
    }


def build_gateway_ingress(g: GatewayWorkload) -> Obj | None:
    """The Ingress of ``spec.gateway.exposure.ingress`` (``None`` without one): ``host`` + ``/v1`` to the
    client Service, TLS from the named Secret, terminated by the ingress controller."""
    ingress = g.exposure.ingress
    if ingress is None:
        return None
    backend = {"service": {"name": gateway_name(g.model_deployment), "port": {"number": GATEWAY_PORT}}}
    spec: Obj = {}
    if ingress.class_name:
        spec["ingressClassName"] = ingress.class_name
    if ingress.tls is not None:
        spec["tls"] = [{"hosts": [ingress.host], "secretName": ingress.tls.secret_name}]
    spec["rules"] = [
        {
            "host": ingress.host,
            "http": {"paths": [{"path": EXPOSED_PATH_PREFIX, "pathType": "Prefix", "backend": backend}]},
        }
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": metadata(
            gateway_name(g.model_deployment),
            g.namespace,
            object_labels(g.model_deployment, "gateway"),
            g.owner,
            dict(sorted(ingress.annotations.items())) or None,
        ),
        "spec": spec,
    }


def route_backend(g: GatewayWorkload) -> Obj:
    """Where the HTTPRoute sends ``/v1``: the shared pool's InferencePool when ``spec.gateway.inferencePool``
    is set (and applied), else the gateway's client Service.

    One route, one backend: an HTTPRoute cannot tell a dedicated tenant's request from a shared one's
    (the tenant is known only once the Endpoint Picker has read the key), so it cannot send each to its
    own pool's InferencePool. The shared pool's is the one every tenant's request may enter: the Endpoint
    Picker picks the replica of the tenant's own pool, dedicated or shared, unless the gateway restricts
    it to the pool's endpoints (GIE's subset hint), in which case a dedicated tenant needs a route of its
    own to its pool's InferencePool (docs/onboarding.md)."""
    if g.inference_pool is not None:
        return {
            "group": INFERENCE_POOL_GROUP,
            "kind": "InferencePool",
            "name": engine_name(g.model_deployment, SHARED_POOL),
        }
    return {"name": gateway_name(g.model_deployment), "port": GATEWAY_PORT}


def build_gateway_http_route(g: GatewayWorkload) -> Obj | None:
    """The Gateway API HTTPRoute of ``spec.gateway.exposure.httpRoute`` (``None`` without one): its
    hostnames + ``/v1`` to the client Service (or the shared pool's InferencePool: ``route_backend``),
    attached to the named Gateways (which terminate TLS)."""
    route = g.exposure.http_route
    if route is None:
        return None
    parents = [p.model_dump(by_alias=True, exclude_none=True) for p in route.parent_refs]
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": metadata(
            gateway_name(g.model_deployment),
            g.namespace,
            object_labels(g.model_deployment, "gateway"),
            g.owner,
        ),
        "spec": {
            "parentRefs": parents,
            "hostnames": list(route.hostnames),
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": EXPOSED_PATH_PREFIX}}],
                    "backendRefs": [route_backend(g)],
                }
            ],
        },
    }


def build_gateway_exposure(g: GatewayWorkload) -> list[Obj]:
    """The Ingress or HTTPRoute the spec asks for (none by default)."""
    return [obj for obj in (build_gateway_ingress(g), build_gateway_http_route(g)) if obj is not None]


def cluster_endpoint(g: GatewayWorkload) -> str:
    """The gateway's in-cluster base URL (the client Service's DNS name)."""
    return f"http://{gateway_name(g.model_deployment)}.{g.namespace}.svc:{GATEWAY_PORT}/v1"


def load_balancer_address(service: Obj | None) -> str | None:
    """The first address the cloud's load balancer controller published on the Service
    (``status.loadBalancer.ingress``: a hostname or an IP), or ``None`` while none is assigned."""
    for entry in ((service or {}).get("status") or {}).get("loadBalancer", {}).get("ingress") or []:
        address = entry.get("hostname") or entry.get("ip")
        if address:
            return str(address)
    return None


def _host_port(address: str, port: int) -> str:
    try:
        is_v6 = ipaddress.ip_address(address).version == 6
    except ValueError:
        is_v6 = False
    return f"[{address}]:{port}" if is_v6 else f"{address}:{port}"


def gateway_endpoint(
    g: GatewayWorkload, live_service: Obj | None = None, withheld: Collection[str] = ()
) -> str:
    """The base URL clients use (``status.endpoint``): the Ingress host (https with TLS), else the
    HTTPRoute's first hostname (https when its Gateway's listener terminates TLS), else a LoadBalancer's
    address once the cloud assigned one (``live_service``: the client Service as read), else the in-cluster
    URL. ``withheld``: kinds (``Ingress``, ``HTTPRoute``) the operator could not create, which give no URL.
    """
    exposure = g.exposure
    if exposure.ingress is not None and "Ingress" not in withheld:
        scheme = "https" if exposure.ingress.tls is not None else "http"
        return f"{scheme}://{exposure.ingress.host}{EXPOSED_PATH_PREFIX}"
    if exposure.http_route is not None and "HTTPRoute" not in withheld:
        scheme = "https" if exposure.http_route.https else "http"
        return f"{scheme}://{exposure.http_route.hostnames[0]}{EXPOSED_PATH_PREFIX}"
    if exposure.service.type is ServiceType.LOAD_BALANCER:
        address = load_balancer_address(live_service)
        if address is not None:
            return f"http://{_host_port(address, GATEWAY_PORT)}{EXPOSED_PATH_PREFIX}"
    return cluster_endpoint(g)


def build_pdb(
    *, namespace: str, model_deployment: str, component: str, pool: str | None, owner: Owner, name: str
) -> Obj:
    """At most one replica of a component down at a time during voluntary disruptions."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(name, namespace, object_labels(model_deployment, component, pool), owner),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(model_deployment, component, pool)},
        },
    }


def build_gateway_pdb(g: GatewayWorkload) -> Obj:
    return build_pdb(
        namespace=g.namespace,
        model_deployment=g.model_deployment,
        component="gateway",
        pool=None,
        owner=g.owner,
        name=gateway_name(g.model_deployment),
    )


def build_engine_pdb(namespace: str, model_deployment: str, pool: str, owner: Owner) -> Obj:
    return build_pdb(
        namespace=namespace,
        model_deployment=model_deployment,
        component="engine",
        pool=pool,
        owner=owner,
        name=engine_name(model_deployment, pool),
    )
