"""Attacks with kvfleet's labels, on the real API server (controller manager, scheduler, kwok nodes).

Threat (issue 23, hole 5): kvfleet finds its own pods by their labels. Each ModelDeployment's Services
(the gateway's, the engines' headless one, the shared tier's) select them, so their EndpointSlices and the
DNS records of the headless Service (``hostname.subdomain``) follow them; so do its NetworkPolicies and
PodMonitors, and the operator's capacity reader listed engine pods by label. A pod in the namespace
wearing the gateway's labels would get a share of the clients' connections (keys and prompts) and its
metrics billed; the shared tier's, every salted tenant's KV writes and reads; an engine replica's
``hostname``/``subdomain``, that replica's DNS answers; a Ready pod with the engine labels reporting one
KV block would shrink the pool's capacity and withdraw tenants' admission.

Defences under test: the chart's reserved-labels ValidatingAdmissionPolicies
(``charts/kvfleet/templates/reserved-labels.yaml``), enforced by the API server for everyone, the cluster
admin included: only the StatefulSet and ReplicaSet controllers create pods wearing the labels, only the
operator's ServiceAccount (and the Deployment controller, for ReplicaSets) workloads whose template wears
them, no update adds them, no such pod takes an ephemeral container. And identity, not labels, in the
operator: the capacity reader reads only pods the ModelDeployment's StatefulSets control, by UID
(``reconcile/capacity.owned_engine_pods``), proven in a namespace the policies do not cover.

Setup: the chart's RBAC (watching one namespace) and its reserved-labels policies, rendered by helm and
applied as an install would; the operator's reconcile runs in process as the chart's ServiceAccount (a
TokenRequest token). At the end the policies are removed, so that later tests may label pods as they like.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import apply_crds, create_namespace, delete_namespace, run_tool, wait_for
from devcluster import ControlPlane

from kvfleet_operator.api import ModelDeployment, reasons
from kvfleet_operator.build.common import PLUGIN_METRICS_PORT, SHARED_TIER_COMPONENT, selector_labels
from kvfleet_operator.build.tenant_table import compute_pool_capacity
from kvfleet_operator.handlers.reconcile import OperatorConfig, ReconcileResult, reconcile_model_deployment
from kvfleet_operator.k8s.client import Credentials, KubeClient
from kvfleet_operator.k8s.engine_metrics import EngineCapacityReader
from operator_support import (
    CONFIG,
    condition,
    create,
    get,
    load_example,
    model_deployment,
    reconcile,
    schedulable_on_kwok,
    tenant_table,
)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
#: The release name; it contains the chart's name, so it is also the full name and the ServiceAccount's.
RELEASE = "kvfleet-labels"
MD = "tiny"
POD_POLICY = f"{RELEASE}-reserved-labels-pods"
WORKLOAD_POLICY = f"{RELEASE}-reserved-labels-workloads"
REFUSED = "labels reserved for kvfleet's own pods"
#: The template annotation ``kubectl rollout restart`` sets.
RESTARTED_AT = "kubectl.kubernetes.io/restartedAt"
#: A loopback address of this machine no other test serves on: the impostor engine pod's "IP".
IMPOSTOR_IP = "127.0.0.23"


@dataclass(frozen=True)
class Setup:
    plane: ControlPlane
    release_ns: str
    ns: str
    operator_kubeconfig: Path
    config: OperatorConfig


def _pod(namespace: str, name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {"containers": [{"name": "c", "image": "busybox:1"}], **spec},
    }


def _post(plane: ControlPlane, doc: dict[str, Any], *, dry_run: bool = False) -> tuple[int, Any]:
    meta = doc["metadata"]
    group, _, version = doc["apiVersion"].rpartition("/")
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    plural = doc["kind"].lower() + "s"
    path = f"{prefix}/namespaces/{meta['namespace']}/{plural}" + ("?dryRun=All" if dry_run else "")
    return plane.request("POST", path, doc)


def _refused_by(body: Any, policy: str) -> bool:
    message = str((body or {}).get("message", ""))
    return f"ValidatingAdmissionPolicy '{policy}'" in message and REFUSED in message


def _reconcile_as_operator(s: Setup) -> ReconcileResult:
    async def go() -> ReconcileResult:
        async with KubeClient(Credentials.from_kubeconfig(s.operator_kubeconfig)) as client:
            return await reconcile_model_deployment(client, s.config, s.ns, MD)

    return asyncio.run(go())


def _pods(plane: ControlPlane, namespace: str, component: str) -> list[dict[str, Any]]:
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(MD, component).items())
    items: list[dict[str, Any]] = get(plane, f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}")[
        "items"
    ]
    return items


def _running(plane: ControlPlane, namespace: str, component: str) -> dict[str, Any] | None:
    for pod in _pods(plane, namespace, component):
        if (pod.get("status") or {}).get("podIP"):
            return pod
    return None


def _endpoint_refs(plane: ControlPlane, namespace: str, service: str) -> list[tuple[str, str]]:
    """(target pod name, hostname) of every endpoint in the Service's EndpointSlices: what DNS answers."""
    slices = get(
        plane,
        f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        f"?labelSelector=kubernetes.io/service-name={service}",
    )["items"]
    return [
        (str((e.get("targetRef") or {}).get("name", "")), str(e.get("hostname", "")))
        for s in slices
        for e in s.get("endpoints") or []
    ]


@pytest.fixture(scope="module")
def setup(full_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    plane = full_cluster
    apply_crds(plane)
    release_ns = create_namespace(plane, "kvfleet-labels")
    ns = create_namespace(plane, "team")
    status, body = plane.request(
        "POST", f"/api/v1/namespaces/{release_ns}/serviceaccounts", {"metadata": {"name": RELEASE}}
    )
    assert status == 201, body
    rendered = run_tool(
        plane, "helm", "template", RELEASE, str(CHART), "-n", release_ns,
        "--set", f"operator.watchNamespaces={{{ns}}}",
        "-s", "templates/rbac.yaml", "-s", "templates/reserved-labels.yaml",
    )  # fmt: skip
    kinds_rendered = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
    assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "Role"} <= kinds_rendered
    try:
        apply_args = ("apply", "--server-side", "--field-manager=helm", "-f", "-")
        run_tool(plane, "kubectl", *apply_args, stdin=rendered)
        probe = _pod(ns, "probe", selector_labels(MD, "gateway"))
        wait_for(
            lambda: _refused_by(_post(plane, probe, dry_run=True)[1], POD_POLICY),
            timeout=60,
            what="the reserved-labels pod policy in force",
        )
        kubeconfig = plane.service_account_kubeconfig(
            release_ns, RELEASE, tmp_path_factory.mktemp("operator") / "sa.kubeconfig"
        )
        config = dataclasses.replace(CONFIG, watch_namespaces=(ns,))
        yield Setup(plane, release_ns, ns, kubeconfig, config)
    finally:
        run_tool(plane, "kubectl", "delete", "--ignore-not-found", "--wait=false", "-f", "-", stdin=rendered)
        for namespace in (ns, release_ns):
            delete_namespace(plane, namespace, wait=True)


@pytest.fixture(scope="module")
def served(setup: Setup) -> Setup:
    """The CPU example ModelDeployment ``tiny`` with one tenant, reconciled by the operator (as the chart's
    ServiceAccount) until nothing changes, its engine and gateway pods running on kwok's nodes."""
    s = setup
    create(s.plane, schedulable_on_kwok(load_example("local/modeldeployment-tiny.yaml", s.ns)))
    create(s.plane, load_example("local/tenant-basic-a.yaml", s.ns))
    for _ in range(4):
        if not _reconcile_as_operator(s).applied:
            break
    for component in ("engine", "gateway"):
        try:
            wait_for(lambda c=component: _running(s.plane, s.ns, c), timeout=120, what=f"the {component} pod")
        except AssertionError as exc:  # say why: a refused create is an event on the workload
            events = get(s.plane, f"/api/v1/namespaces/{s.ns}/events")["items"]
            raise AssertionError(f"{exc}; events: {[e.get('message') for e in events][-8:]}") from None
    return s


def test_the_operators_pods_are_admitted_and_are_their_services_endpoints(served: Setup) -> None:
    """The legitimate path through the policies: the operator's identity creates the StatefulSet and the
    Deployment, the Deployment controller the ReplicaSet, the StatefulSet and ReplicaSet controllers the
    pods wearing the labels; each pod is its Service's endpoint (the engine's with its DNS hostname)."""
    s = served
    engine = _running(s.plane, s.ns, "engine")
    gateway = _running(s.plane, s.ns, "gateway")
    assert engine is not None and gateway is not None
    wait_for(
        lambda: (
            (engine["metadata"]["name"], engine["spec"].get("hostname", ""))
            in _endpoint_refs(s.plane, s.ns, engine["spec"]["subdomain"])
        ),
        timeout=60,
        what="the engine pod in its headless Service's EndpointSlice, with its hostname",
    )


def _engine_lookalike(s: Setup) -> dict[str, Any]:
    """A pod wearing the engine's headless Service selector, with replica 0's hostname and subdomain."""
    engine = _running(s.plane, s.ns, "engine")
    assert engine is not None
    service = str(engine["spec"]["subdomain"])
    selector = get(s.plane, f"/api/v1/namespaces/{s.ns}/services/{service}")["spec"]["selector"]
    return _impostor(s, selector, hostname=engine["spec"]["hostname"], subdomain=service)


def _impostor(s: Setup, labels: dict[str, str], **spec: Any) -> dict[str, Any]:
    return _pod(s.ns, "impostor", labels, **spec)


#: Each attack: a pod (made from the live objects) wearing labels some kvfleet Service or policy selects.
POD_ATTACKS: dict[str, Callable[[Setup], dict[str, Any]]] = {
    "gateway-service-selector": lambda s: _impostor(
        s, get(s.plane, f"/api/v1/namespaces/{s.ns}/services/{MD}-gateway")["spec"]["selector"]
    ),
    "shared-tier-selector": lambda s: _impostor(s, selector_labels(MD, SHARED_TIER_COMPONENT)),
    "engine-selector-with-the-hostname-of-replica-0": _engine_lookalike,
    "engine-pod-copied-whole": lambda s: _copy_pod(_running(s.plane, s.ns, "engine")),
    "managed-by-the-operator": lambda s: _impostor(s, {"app.kubernetes.io/managed-by": "kvfleet-operator"}),
    "a-kvfleet-pool-key": lambda s: _impostor(s, {"kvfleet.io/pool": "shared"}),
}


def _copy_pod(pod: dict[str, Any] | None) -> dict[str, Any]:
    assert pod is not None
    doc = {"apiVersion": "v1", "kind": "Pod", "spec": copy.deepcopy(pod["spec"])}
    doc["metadata"] = {
        "name": "impostor",
        "namespace": pod["metadata"]["namespace"],
        "labels": pod["metadata"]["labels"],
    }
    doc["spec"].pop("nodeName", None)
    return doc


@pytest.mark.parametrize("attack", POD_ATTACKS, ids=POD_ATTACKS)
def test_a_pod_wearing_kvfleets_labels_is_refused(served: Setup, attack: str) -> None:
    """Attack: the cluster admin (anyone who may create pods in the namespace) creates a pod wearing the
    gateway's, the shared tier's or an engine's Service selector (with the replica's hostname and the
    headless Service as subdomain), a whole copy of the engine pod, or a single reserved label. The API
    server refuses each with the policy's message; the same pod without the labels is admitted (so the
    policy is what refused it), and such a pod is no endpoint (next test)."""
    doc = POD_ATTACKS[attack](served)
    status, body = _post(served.plane, doc)
    assert status == 403 and _refused_by(body, POD_POLICY), (status, body)
    benign = copy.deepcopy(doc)
    benign["metadata"]["labels"] = {"app": "mine"}
    status, body = _post(served.plane, benign, dry_run=True)
    assert status == 201, body


def test_a_pod_with_an_engine_replicas_hostname_gets_no_endpoint_and_no_dns_name(served: Setup) -> None:
    """Attack: without the labels (refused above), a pod takes engine replica 0's ``hostname`` and the
    headless Service as ``subdomain``, on the engine's own node. It runs (kwok gives it an IP), but the
    EndpointSlice controller publishes only the pods the Service selects, so the replica's name (the
    slices' hostname, what cluster DNS answers) keeps pointing at the StatefulSet's pod alone."""
    s = served
    engine = _running(s.plane, s.ns, "engine")
    assert engine is not None
    service = str(engine["spec"]["subdomain"])
    hostname = str(engine["spec"]["hostname"])
    doc = _pod(s.ns, "lookalike", {"app": "mine"}, hostname=hostname, subdomain=service)
    doc["spec"] |= {
        "nodeName": engine["spec"]["nodeName"],
        "tolerations": engine["spec"].get("tolerations", []),
    }
    status, body = _post(s.plane, doc)
    assert status == 201, body
    wait_for(
        lambda: (get(s.plane, f"/api/v1/namespaces/{s.ns}/pods/lookalike").get("status") or {}).get("podIP"),
        timeout=60,
        what="the look-alike pod running with an IP",
    )
    # The EndpointSlice controller has seen the pod once the Service's slice is rewritten for any reason;
    # give it the time it takes to publish a new pod (well under a second here), then look.
    wait_for(
        lambda: _endpoint_refs(s.plane, s.ns, service), timeout=30, what="the engine Service's endpoints"
    )
    refs = _endpoint_refs(s.plane, s.ns, service)
    assert all(name != "lookalike" for name, _ in refs), refs
    assert [name for name, host in refs if host == hostname] == [engine["metadata"]["name"]], refs


def _workload(kind: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    template = {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": "busybox:1"}]}}
    if kind == "ReplicationController":
        return {
            "apiVersion": "v1",
            "kind": kind,
            "metadata": {"name": "intruder", "namespace": namespace},
            "spec": {"selector": labels, "template": template},
        }
    if kind == "CronJob":
        template["spec"]["restartPolicy"] = "Never"
        return {
            "apiVersion": "batch/v1",
            "kind": kind,
            "metadata": {"name": "intruder", "namespace": namespace},
            "spec": {"schedule": "0 0 1 1 *", "jobTemplate": {"spec": {"template": template}}},
        }
    spec: dict[str, Any] = {"selector": {"matchLabels": labels}, "template": template}
    if kind == "StatefulSet":
        spec["serviceName"] = "intruder"
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": "intruder", "namespace": namespace},
        "spec": spec,
    }


@pytest.mark.parametrize(
    ("kind", "component"),
    [
        ("Deployment", "gateway"),
        ("StatefulSet", "engine"),
        ("ReplicaSet", SHARED_TIER_COMPONENT),
        ("ReplicationController", "gateway"),
        ("CronJob", "engine"),
    ],
)
def test_a_workload_whose_pods_would_wear_kvfleets_labels_is_refused(
    served: Setup, kind: str, component: str
) -> None:
    """Attack: a workload whose controller would create the labelled pods for the user (the controllers
    are the pods' allowed creators). Refused unless the operator's ServiceAccount creates it; the same
    workload under its own labels is admitted."""
    doc = _workload(kind, served.ns, selector_labels(MD, component))
    status, body = _post(served.plane, doc)
    assert status == 403 and _refused_by(body, WORKLOAD_POLICY), (status, body)
    status, body = _post(served.plane, _workload(kind, served.ns, {"app": "mine"}), dry_run=True)
    assert status == 201, body


def test_labels_cannot_be_added_to_a_running_pod_or_the_operators_workload_changed(served: Setup) -> None:
    """Attack: an ordinary pod relabelled as the gateway afterwards (labels are mutable); the operator's
    engine StatefulSet's template edited by hand. Both refused; other label changes stay allowed (the
    controllers make them), on the ordinary pod and on kvfleet's own pods alike, and so does a
    ``kubectl rollout restart`` of kvfleet's StatefulSet (its restartedAt annotation, nothing else)."""
    s = served
    status, body = _post(s.plane, _pod(s.ns, "ordinary", {"app": "mine"}))
    assert status == 201, body
    merge = "application/merge-patch+json"
    path = f"/api/v1/namespaces/{s.ns}/pods/ordinary"
    patch = {"metadata": {"labels": selector_labels(MD, "gateway")}}
    status, body = s.plane.request("PATCH", path, patch, content_type=merge)
    assert status == 403 and _refused_by(body, POD_POLICY), (status, body)
    assert s.plane.request("PATCH", path, {"metadata": {"labels": {"x": "y"}}}, content_type=merge)[0] == 200

    gateway = _running(s.plane, s.ns, "gateway")
    assert gateway is not None
    own = f"/api/v1/namespaces/{s.ns}/pods/{gateway['metadata']['name']}"
    assert s.plane.request("PATCH", own, {"metadata": {"labels": {"x": "y"}}}, content_type=merge)[0] == 200
    moved = {"metadata": {"labels": {"app.kubernetes.io/instance": "another-md"}}}
    status, body = s.plane.request("PATCH", own, moved, content_type=merge)
    assert status == 403 and _refused_by(body, POD_POLICY), (status, body)

    sts = f"/apis/apps/v1/namespaces/{s.ns}/statefulsets/{MD}-engine"
    edit = {"spec": {"template": {"metadata": {"annotations": {"edited": "by-hand"}}}}}
    status, body = s.plane.request("PATCH", sts, edit, content_type=merge)
    assert status == 403 and _refused_by(body, WORKLOAD_POLICY), (status, body)
    assert s.plane.request("PATCH", sts, {"metadata": {"labels": {"x": "y"}}}, content_type=merge)[0] == 200
    # What `kubectl rollout restart` writes stays allowed: a rolling restart of kvfleet's own pods.
    restart = {"spec": {"template": {"metadata": {"annotations": {RESTARTED_AT: "2026-01-01T00:00:00Z"}}}}}
    status, body = s.plane.request("PATCH", sts, restart, content_type=merge)
    assert status == 200, body
    both = {
        "spec": {"template": {"metadata": {"annotations": {RESTARTED_AT: "2026-01-02T00:00:00Z", "x": "y"}}}}
    }
    status, body = s.plane.request("PATCH", sts, both, content_type=merge)
    assert status == 403 and _refused_by(body, WORKLOAD_POLICY), (status, body)


def test_no_ephemeral_container_joins_a_kvfleet_pod(served: Setup) -> None:
    """Attack: ``kubectl debug`` on the gateway pod (keys and prompts in its memory) adds an ephemeral
    container through the ``pods/ephemeralcontainers`` subresource. Refused; the same on an ordinary pod
    is admitted."""
    s = served
    gateway = _running(s.plane, s.ns, "gateway")
    assert gateway is not None
    strategic = "application/strategic-merge-patch+json"
    debugger = {"spec": {"ephemeralContainers": [{"name": "debugger", "image": "busybox:1"}]}}
    path = f"/api/v1/namespaces/{s.ns}/pods/{gateway['metadata']['name']}/ephemeralcontainers"
    status, body = s.plane.request("PATCH", path, debugger, content_type=strategic)
    assert status == 403 and _refused_by(body, POD_POLICY), (status, body)
    status, body = _post(s.plane, _pod(s.ns, "debuggable", {"app": "mine"}))
    assert status == 201, body
    path = f"/api/v1/namespaces/{s.ns}/pods/debuggable/ephemeralcontainers"
    assert s.plane.request("PATCH", path, debugger, content_type=strategic)[0] == 200


class _OneBlock(BaseHTTPRequestHandler):
    """What a malicious pod answers on the engine metrics port: vLLM's info gauge with one KV block."""

    def do_GET(self) -> None:
        body = b'vllm:cache_config_info{block_size="16",num_gpu_blocks="1"} 1.0\n'
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def one_block_server() -> Iterator[str]:
    server = ThreadingHTTPServer((IMPOSTOR_IP, PLUGIN_METRICS_PORT), _OneBlock)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield IMPOSTOR_IP
    finally:
        server.shutdown()
        server.server_close()


def test_the_capacity_reader_ignores_a_labelled_pod_the_statefulset_does_not_own(
    full_cluster: ControlPlane, one_block_server: str
) -> None:
    """Attack, where no policy covers the namespace (defence in depth): a Ready pod wearing the engine
    labels whose metrics port reports one KV block (a real HTTP server at the pod's IP). The operator's
    capacity reader, run by the real reconcile, reads only pods the ModelDeployment's StatefulSet controls:
    the pool keeps its planned capacity, nothing is recorded as reported, nothing says CapacityBelowPlan.
    (Before: reportedBlocks 1, the tenant table sized for one block.)"""
    plane = full_cluster
    apply_crds(plane)
    ns = create_namespace(plane, "unguarded")
    try:
        md = schedulable_on_kwok(load_example("local/modeldeployment-tiny.yaml", ns))
        create(plane, md)
        create(plane, load_example("local/tenant-basic-a.yaml", ns))
        config = dataclasses.replace(
            CONFIG, watch_namespaces=(ns,), engine_capacity=EngineCapacityReader(timeout_s=2, retry_s=0)
        )
        reconcile(plane, ns, MD, config)
        labels = selector_labels(MD, "engine", "shared")
        # On a node no kubelet (nor kwok) runs: its status is what its creator writes.
        status, body = _post(plane, _pod(ns, "impostor", labels, nodeName="no-such-node"))
        assert status == 201, body
        ready = {
            "status": {
                "phase": "Running",
                "podIP": one_block_server,
                "podIPs": [{"ip": one_block_server}],
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        }
        status, body = plane.request(
            "PATCH",
            f"/api/v1/namespaces/{ns}/pods/impostor/status",
            ready,
            content_type="application/merge-patch+json",
        )
        assert status == 200, body
        for _ in range(3):
            reconcile(plane, ns, MD, config)
        planned = compute_pool_capacity(
            ModelDeployment.model_validate(model_deployment(plane, ns, MD))
        ).hbm_blocks
        found = model_deployment(plane, ns, MD)
        kv = found["status"]["kvCapacity"]
        assert kv.get("reportedBlocks") is None, kv
        assert kv["perReplica"]["hbm"]["blocks"] == planned, kv
        assert condition(found, "Degraded").get("reason") != reasons.CAPACITY_BELOW_PLAN
        assert tenant_table(plane, ns, MD).pools["shared"].hbm_blocks_per_replica == planned
    finally:
        delete_namespace(plane, ns, wait=False)
