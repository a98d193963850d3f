"""kvfleet on the real node tier, as a user runs it: ``helm install`` → ``kubectl apply`` → traffic.

Shared by ``hack/demo.py`` (its "real pods" mode) and ``tests/e2e/test_real_node.py``, so the demo and
the tests install, apply and reach the product the same way. The builders (``build_*``) are pure; the
rest talks to a running ``node`` tier plane.

* :func:`real_pods_blockers` is the probe: what stops the product from running in real pods here (root,
  the node's binaries, the images of the current tree, the tiny model), each with the command that
  provides it; empty means the node tier can run it.
* :func:`helm_install`, :func:`provide_model_volume`, :func:`apply_examples`,
  :func:`wait_for_engine_and_gateway`: the user's steps.
* :func:`gateway_service_url`, :func:`tenant_keys`: how a client reaches the gateway's Service.
* :func:`build_pod_discovery_config`, :func:`create_scraper_identity`: Prometheus discovering the pods'
  metrics ports through the API server as the scrapers' ServiceAccount.
"""

from __future__ import annotations

import base64
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from . import binaries
from .node import http_ok, kvfleet_images, missing_node_components
from .prometheus import PrometheusServer, start_prometheus

REPO = Path(__file__).resolve().parents[2]
RELEASE, RELEASE_NS, MD = "kvfleet", "kvfleet-system", "tiny"
#: The ``restricted`` Pod Security Standard, enforced on every namespace the product's pods run in.
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
#: The claim examples/local's ModelDeployment reads the tiny model from (a PV a platform team provides).
MODELS_CLAIM = "models"
#: The scrapers' ServiceAccount (in the scrapers' namespace) and the ClusterRole its pod discovery needs.
SCRAPER_SA = "prometheus"
SCRAPER_ROLE = "kvfleet-pod-discovery"
#: The Prometheus job that discovers the pods; its targets are every container port named ``metrics``.
POD_DISCOVERY_JOB = "kvfleet-pods"
#: Prometheus and promtool with Kubernetes service discovery (Debian's 2.42 is built without it), built by
#: ``KVFLEET_BUILD_STEPS=prometheus-k8s hack/build-cluster.sh`` (part of the ``node`` step).
PROMETHEUS_K8S = ("prometheus-k8s", "promtool-k8s")

T = TypeVar("T")


class KubeError(RuntimeError):
    """The API server answered a request with an error status."""


def kube(plane: Any, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
    """One API request on ``plane`` (a ``ControlPlane``); its JSON answer, or :class:`KubeError`."""
    status, payload = plane.request(method, path, body, content_type=ctype, timeout=30)
    if status >= 300:
        raise KubeError(f"{method} {path}: {status} {payload}")
    return payload


def kubectl(plane: Any, *args: str, check: bool = True, timeout: float = 120) -> str:
    """``kubectl`` against ``plane``: stdout + stderr (raises :class:`KubeError` on failure if ``check``)."""
    out = subprocess.run(
        [str(binaries.require_binary("kubectl")), *args],
        env=plane.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and out.returncode != 0:
        raise KubeError(f"kubectl {' '.join(args)}: {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out.stdout + out.stderr


def wait_for(
    check: Callable[[], T | None], what: str, timeout: float, plane: Any = None, interval: float = 2.0
) -> T:
    """``check()``'s first truthy answer; :class:`TimeoutError` after ``timeout`` s (with every pod and
    event of ``plane`` in the message, when given: what a human looks at first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    detail = ""
    if plane is not None:
        detail = "\n" + kubectl(plane, "get", "pods,events", "-A", "-o", "wide", check=False)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")


# --- the probe ---------------------------------------------------------------------------------------------


def images_of_tree() -> dict[str, str]:
    """image -> the content ref ``hack/images.sh`` would tag for the current tree (``--print``)."""
    printed = subprocess.run(
        [str(REPO / "hack/images.sh"), "--print"], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    return {
        name: ref for name, ref in (line.split(" ", 1) for line in printed.splitlines()) if name != "base"
    }


def real_pods_blockers() -> list[tuple[str, str]]:
    """What keeps kvfleet from running in real pods on this machine: ``(what is missing, the command that
    provides it)`` for each; empty: the node tier can start and run the current tree's images."""
    blockers: list[tuple[str, str]] = []
    missing = binaries.missing_binaries((*binaries.FULL_TIER_BINARIES, "helm", "kubectl", *PROMETHEUS_K8S))
    missing += missing_node_components()
    if missing:
        blockers.append((f"real node tier {missing}", "hack/provision.d/30-node.sh"))
    want = images_of_tree()
    have = {name: refs[0] for name, refs in kvfleet_images().items()}
    if have != want:
        blockers.append((f"kvfleet images of the current tree {want} (built: {have})", "make images"))
    if not (binaries.cache_dir() / "models" / "tiny-llama" / "config.json").is_file():
        blockers.append(("the tiny model", ".venv/bin/python -m kvfleet_runtime engine build-tiny-model"))
    return blockers


# --- the user's steps --------------------------------------------------------------------------------------


def create_namespace(plane: Any, name: str, labels: Mapping[str, str] | None = None) -> None:
    """Create namespace ``name`` with ``labels`` (default: :data:`RESTRICTED`); one that exists is kept."""
    metadata = {"name": name, "labels": dict(RESTRICTED if labels is None else labels)}
    status, payload = plane.request("POST", "/api/v1/namespaces", {"metadata": metadata}, timeout=30)
    if status not in (201, 409):
        raise KubeError(f"creating namespace {name}: {status} {payload}")


def helm_install(
    plane: Any, watch_namespaces: Sequence[str], timeout: str = "300s", values: Sequence[str] = ()
) -> None:
    """``helm upgrade --install`` of charts/kvfleet with its default images (what ``make images`` tagged)
    and the operator watching ``watch_namespaces`` (they must exist: the chart binds a Role in each);
    ``values``: more ``--set`` values, as a platform team sets them (e.g. ``guardrails.serviceTypes``)."""
    helm = str(binaries.require_binary("helm"))
    more = [arg for value in values for arg in ("--set", value)]
    out = subprocess.run(
        [helm, "upgrade", "--install", RELEASE, str(REPO / "charts/kvfleet"), "--namespace", RELEASE_NS,
         "--create-namespace", "--set", f"operator.watchNamespaces={{{','.join(watch_namespaces)}}}",
         *more, "--wait", "--timeout", timeout],
        env=plane.env(), capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        pods = kubectl(plane, "get", "pods,events", "-A", check=False)
        raise KubeError(f"helm install failed ({out.returncode}):\n{out.stdout}{out.stderr}\n{pods}")


def provide_model_volume(plane: Any, namespace: str, pv_name: str) -> None:
    """What a platform team provides: a PV holding the weights (a hostPath on the node: the model cache)
    and the claim the ModelDeployment names. The pod only sees a persistentVolumeClaim volume, which the
    ``restricted`` standard allows (a hostPath volume in the pod itself would not be)."""
    models = binaries.cache_dir() / "models"
    kube(plane, "POST", "/api/v1/persistentvolumes", {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain",
                 "hostPath": {"path": str(models), "type": "Directory"},
                 "claimRef": {"namespace": namespace, "name": MODELS_CLAIM}},
    })  # fmt: skip
    kube(plane, "POST", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": MODELS_CLAIM},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv_name,
                 "resources": {"requests": {"storage": "1Gi"}}},
    })  # fmt: skip


def build_example_documents(namespace: str) -> list[dict[str, Any]]:
    """examples/local's manifests for ``namespace``, the ModelDeployment reading the model from
    :data:`MODELS_CLAIM` and running vLLM-CPU eagerly: the engine image has no compiler (by design), and
    torch inductor's graph compilation needs one."""
    docs = []
    for path in sorted((REPO / "examples/local").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            doc["metadata"]["namespace"] = namespace
            if doc["kind"] == "ModelDeployment":
                doc["spec"]["model"]["source"]["pvc"] = {"claimName": MODELS_CLAIM, "path": "/tiny-llama"}
                doc["spec"]["engine"]["extraArgs"] = ["--enforce-eager"]
            docs.append(doc)
    return docs


def apply_examples(plane: Any, namespace: str, field_manager: str) -> list[dict[str, Any]]:
    """Server-side apply :func:`build_example_documents` (as ``kubectl apply --server-side``)."""
    docs = build_example_documents(namespace)
    for doc in docs:
        plural = {"ModelDeployment": "modeldeployments", "Tenant": "tenants"}[doc["kind"]]
        name = doc["metadata"]["name"]
        kube(
            plane,
            "PATCH",
            f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/{plural}/{name}"
            f"?fieldManager={field_manager}&force=true",
            doc,
            "application/apply-patch+yaml",
        )
    return docs


def pods(plane: Any, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kube(
        plane, "GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}"
    )["items"]
    return items


def is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def component_ready(plane: Any, namespace: str, component: str) -> bool:
    """Every pod of ``app.kubernetes.io/component=<component>`` in ``namespace`` is Ready (and one exists)."""
    found = pods(plane, namespace, f"app.kubernetes.io/component={component}")
    return bool(found) and all(is_ready(p) for p in found)


def wait_for_engine_and_gateway(plane: Any, namespace: str, engine_timeout: float = 1200) -> None:
    """Until the engine pod (vLLM-CPU + LMCache from the engine image: minutes on 2 cores) and the
    gateway pod are Ready."""
    wait_for(
        lambda: component_ready(plane, namespace, "engine"),
        "the engine pod Ready (vLLM-CPU + LMCache from the engine image)",
        engine_timeout,
        plane,
    )
    wait_for(lambda: component_ready(plane, namespace, "gateway"), "the gateway pod Ready", 300, plane)


# --- reaching the gateway ----------------------------------------------------------------------------------


def gateway_service_url(plane: Any, namespace: str, md: str = MD, timeout: float = 60) -> str:
    """``http://<ClusterIP>:<port>`` of the ModelDeployment's gateway Service, once it routes: kube-proxy's
    rules take a connection from this machine (or any pod) to a gateway pod. A pod just Ready is not yet
    behind its Service (the endpoint slice, then kube-proxy's next sync): until then a connection is
    refused, so this waits for the gateway's ``/readyz`` to answer through the Service."""
    service = kube(plane, "GET", f"/api/v1/namespaces/{namespace}/services/{md}-gateway")
    port = next(p["port"] for p in service["spec"]["ports"] if p.get("name") == "http")
    url = f"http://{service['spec']['clusterIP']}:{port}"
    what = f"the gateway Service {namespace}/{md}-gateway routing to a Ready pod"
    wait_for(lambda: http_ok(url + "/readyz"), what, timeout, plane, interval=0.5)
    return url


def tenant_keys(plane: Any, namespace: str, tenants: Sequence[str]) -> dict[str, str]:
    """tenant -> its API key, read from the Secret its status names (as a client would be handed it)."""
    keys = {}
    for name in tenants:
        tenant = kube(plane, "GET", f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenants/{name}")
        secret_name = tenant["status"]["apiKeySecretName"]
        secret = kube(plane, "GET", f"/api/v1/namespaces/{namespace}/secrets/{secret_name}")
        keys[name] = base64.b64decode(secret["data"]["api-key"]).decode()
    return keys


# --- Prometheus through pod discovery ----------------------------------------------------------------------


def build_pod_discovery_config(
    kubeconfig: Path, namespaces: Sequence[str], *, interval: str = "2s"
) -> dict[str, Any]:
    """A Prometheus config that discovers the pods of ``namespaces`` through the API server (``role:
    pod``, authenticated by ``kubeconfig``) and scrapes every container port named ``metrics`` (the
    operator's, the gateway's and the engine's; the engine's re-exports vLLM's, LMCache's and the quota
    sync's series). Targets carry ``namespace``, ``pod`` and ``component`` labels."""
    meta = "__meta_kubernetes_pod_"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": POD_DISCOVERY_JOB,
                "kubernetes_sd_configs": [
                    {
                        "role": "pod",
                        "kubeconfig_file": str(kubeconfig),
                        "namespaces": {"names": list(namespaces)},
                    }
                ],
                "relabel_configs": [
                    {"source_labels": [f"{meta}container_port_name"], "regex": "metrics", "action": "keep"},
                    {"source_labels": [f"{meta}phase"], "regex": "Running", "action": "keep"},
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": [f"{meta}name"], "target_label": "pod"},
                    {
                        "source_labels": [f"{meta}label_app_kubernetes_io_component"],
                        "target_label": "component",
                    },
                ],
            }
        ],
    }


def start_pod_discovery_prometheus(kubeconfig: Path, namespaces: Sequence[str]) -> PrometheusServer:
    """The real Prometheus (:data:`PROMETHEUS_K8S`) with :func:`build_pod_discovery_config`, ready."""
    return start_prometheus(build_pod_discovery_config(kubeconfig, namespaces), binary_names=PROMETHEUS_K8S)


def create_scraper_identity(plane: Any, namespace: str, kubeconfig: Path) -> Path:
    """The scrapers' ServiceAccount in ``namespace`` with read access to pods (what pod discovery
    needs, nothing more), and a kubeconfig at ``kubeconfig`` that authenticates as it."""
    kube(plane, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": SCRAPER_SA}})
    kube(plane, "POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", {
        "metadata": {"name": SCRAPER_ROLE},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    })  # fmt: skip
    kube(plane, "POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
        "metadata": {"name": f"{SCRAPER_ROLE}-{namespace}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": SCRAPER_ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": SCRAPER_SA, "namespace": namespace}],
    })  # fmt: skip
    path: Path = plane.service_account_kubeconfig(namespace, SCRAPER_SA, kubeconfig)
    return path


def ci() -> bool:
    """Under ``CI=true`` a real component that cannot run is a failure, never a fallback or a skip."""
    return os.environ.get("CI", "").lower() == "true"
