"""A GPU node stops reporting: its engine pod is evicted and replaced on another node, and what the gateway
reaches behind the replica's name follows. On a control plane of its own (real kube-apiserver,
kube-controller-manager's node lifecycle controller, kube-scheduler, kwok), because the session's plane
waits 900 s before calling a fake node NotReady (``devcluster.cluster``) and this one waits 20 s.

The lost node is a kwok node like the others but kept by a kwok process of its own, which plays that
node's kubelet: ``kill -9`` of it stops the node's Lease renewals and status, exactly what a dead kubelet
(or a dead machine) leaves behind. Nothing here taints the node NotReady or deletes the pod: the node
lifecycle controller marks the node and its pods, taints it ``node.kubernetes.io/unreachable:NoExecute``,
and its taint manager evicts the engine pod once the pod's toleration (30 s, ``build/engine.py``) runs
out.

An engine pod belongs to a StatefulSet, which never starts a second pod of the same name while the first
may still run: an evicted pod on a node nobody hears from stays ``Terminating`` (nobody confirms it
stopped). The operator confirms it (``spec.pool.nodeLoss``, ``reconcile/node_loss.py``): once the pod's
deletion grace period plus ``nodeLoss.after`` has passed it force-deletes the pod (uid precondition) and
the StatefulSet starts the replacement on the spare node; nobody taints the node out-of-service. With
``nodeLoss.replace: false`` the pod stays past that time, the operator says why in an Event, and only the
``node.kubernetes.io/out-of-service`` taint (non-graceful node shutdown) lets the pod garbage collector
delete it. docs/operations.md ("A GPU node is lost") says what a platform team can expect.

The tenant table names each replica by its stable StatefulSet name (``<pool>-<i>.<svc>``), so it stays
the same; what changes is which pod answers that name: the engine Service's EndpointSlice, and the
ModelDeployment's ``readyReplicas``. The test measures each step from the moment the kubelet died and
prints them (``-s`` shows them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import wait_for
from devcluster import ControlPlane, build_layout, build_node_manifest, missing_binaries, start_control_plane
from devcluster.binaries import BUILD_COMMAND, FULL_TIER_BINARIES, kwok_stage_files, require_binary
from devcluster.cluster import build_kwok_args, kwok_node_lease_seconds
from devcluster.layout import GPU_POOL_LABEL, KWOK_NODE_ANNOTATION, FakeNode
from devcluster.processes import ManagedProcess, start_process
from operators import OperatorReplica, prepare_namespace
from test_operator_reconcile import get

from components import missing_component
from factories import free_port
from kvfleet_operator.build.common import config_map_name, engine_name
from kvfleet_operator.build.engine import NODE_LOSS_TOLERATION_SECONDS
from kvfleet_operator.reconcile.node_loss import (
    DELETION_BY_TAINT_MANAGER,
    DISRUPTION_TARGET,
    ENGINE_POD_REPLACED,
    evicted_from_lost_node,
)
from kvfleet_operator.reconcile.node_loss import ENGINE_POD_STUCK_ON_LOST_NODE as STUCK

#: kube-controller-manager's ``--node-monitor-grace-period`` on this test's plane (Kubernetes' default is
#: 50 s; kwok renews a node's Lease every 10 s, so 20 s survives one late renewal).
GRACE_PERIOD_S = 20
MD = "qwen72b"
STS = engine_name(MD, "shared")
LOST, SPARE = "gpu-lost", "gpu-spare"
#: The annotation value of the lost node: only its own kwok manages it.
LOST_KWOK = "lost"
UNREACHABLE = "node.kubernetes.io/unreachable"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
#: ``spec.pool.nodeLoss.after`` of this test's ModelDeployment: short, so the test is; the default is 60 s.
NODE_LOSS_AFTER_S = 10


@dataclass
class Timeline:
    """Seconds from the kubelet's death to each step."""

    start: float = field(default_factory=time.monotonic)
    steps: dict[str, float] = field(default_factory=dict)

    def mark(self, step: str) -> float:
        self.steps[step] = round(time.monotonic() - self.start, 1)
        return self.steps[step]


def _gpu_node(name: str) -> dict[str, Any]:
    """A shared-pool node like the layout's (8 H200, 512Gi): one engine replica of the example fits."""
    (template,) = build_layout(shared_nodes=1, dedicated={}).shared_pool
    labels = {**template.labels, "kubernetes.io/hostname": name, GPU_POOL_LABEL: "shared"}
    return build_node_manifest(FakeNode(name=name, labels=labels, gpus=template.gpus))


def _start_node_kubelet(plane: ControlPlane) -> ManagedProcess:
    """The lost node (annotated for its own kwok) and the kwok that keeps it Ready: its kubelet."""
    node = _gpu_node(LOST)
    node["metadata"]["annotations"][KWOK_NODE_ANNOTATION] = LOST_KWOK
    status, body = plane.request("POST", "/api/v1/nodes", node)
    assert status == 201, body
    argv = build_kwok_args(
        require_binary("kwok"),
        plane.kubeconfig,
        free_port(),
        kwok_stage_files(),
        LOST_KWOK,
        node_lease_s=kwok_node_lease_seconds(GRACE_PERIOD_S),
    )
    return start_process("kwok-lost-node", argv, plane.workdir / "logs")


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _node(plane: ControlPlane, name: str) -> dict[str, Any]:
    return get(plane, f"/api/v1/nodes/{name}")


def _ready_status(node: dict[str, Any]) -> str:
    conditions = node.get("status", {}).get("conditions") or []
    return next((str(c["status"]) for c in conditions if c["type"] == "Ready"), "")


def _schedulable(plane: ControlPlane, name: str) -> bool:
    node = _node(plane, name)
    taints = node.get("spec", {}).get("taints") or []
    return _ready_status(node) == "True" and not any(
        t["key"].startswith("node.kubernetes.io/") for t in taints
    )


def _engine_pods(plane: ControlPlane, namespace: str) -> dict[str, dict[str, Any]]:
    pods = get(plane, f"/api/v1/namespaces/{namespace}/pods?labelSelector=app.kubernetes.io/component=engine")
    return {p["metadata"]["name"]: p for p in pods["items"]}


def _running_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
    return status.get("phase") == "Running" and ready and not pod["metadata"].get("deletionTimestamp")


def _ready_endpoints(plane: ControlPlane, namespace: str) -> dict[str, str]:
    """Pod name -> pod uid of every ready endpoint of the engine's headless Service (what its DNS names
    resolve to)."""
    slices = get(
        plane, f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?labelSelector="
        f"kubernetes.io/service-name={STS}",
    )  # fmt: skip
    return {
        e["targetRef"]["name"]: e["targetRef"]["uid"]
        for s in slices["items"]
        for e in s.get("endpoints") or []
        if (e.get("conditions") or {}).get("ready") and e.get("targetRef")
    }


def _md_ready_replicas(plane: ControlPlane, namespace: str) -> int:
    md = get(plane, f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/modeldeployments/{MD}")
    return int((md.get("status") or {}).get("readyReplicas") or 0)


def _tenant_table(plane: ControlPlane, namespace: str) -> dict[str, Any]:
    cm = get(plane, f"/api/v1/namespaces/{namespace}/configmaps/{config_map_name(MD)}")
    data: dict[str, Any] = cm["data"]
    return data


@dataclass
class Scene:
    plane: ControlPlane
    kubelet: ManagedProcess
    namespace: str
    operator: OperatorReplica
    #: ``spec.pool.nodeLoss.replace`` of the ModelDeployment.
    replace: bool


@pytest.fixture(params=[True, False], ids=["the-operator-replaces", "replace-off-waits-for-out-of-service"])
def scene(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Scene]:
    replace: bool = request.param
    missing = missing_binaries(FULL_TIER_BINARIES)
    if missing:
        missing_component(f"Kubernetes control plane binaries {', '.join(missing)}", BUILD_COMMAND)
    # One node of the session's kind (kept by the plane's kwok) and later a spare: the two engine replicas
    # (8 GPUs and 288Gi each) land one on it and one on the node that will be lost.
    plane = start_control_plane(
        "full",
        layout=build_layout(shared_nodes=1, dedicated={}),
        timeout=180,
        node_monitor_grace_period_s=GRACE_PERIOD_S,
    )
    kubelet: ManagedProcess | None = None
    operator: OperatorReplica | None = None
    try:
        kubelet = _start_node_kubelet(plane)
        wait_for(lambda: _schedulable(plane, LOST), timeout=60, what=f"{LOST} Ready")
        namespace = prepare_namespace(plane, "nodeloss", tenants=("saas",))
        md_path = f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/modeldeployments/{MD}"
        # No NVMe tier: a local volume is bound to its node, and a replica whose claim sits on a lost node
        # cannot move (docs/operations.md says what that takes).
        status, body = plane.request(
            "PATCH",
            md_path,
            {
                "spec": {
                    "kvCache": {"nvme": None},
                    "pool": {"nodeLoss": {"replace": replace, "after": f"{NODE_LOSS_AFTER_S}s"}},
                }
            },
            content_type="application/merge-patch+json",
        )
        assert status == 200, body
        operator = OperatorReplica(plane, namespace, "kvfleet-0", tmp_path)
        operator.start()
        yield Scene(plane, kubelet, namespace, operator, replace)
    finally:
        if operator is not None:
            operator.kill()
        if kubelet is not None:
            kubelet.stop()
        plane.stop()


def _diagnosis(scene: Scene) -> str:
    """What the cluster and the operator looked like, for a failure message."""
    plane, ns = scene.plane, scene.namespace
    sts = plane.request("GET", f"/apis/apps/v1/namespaces/{ns}/statefulsets/{STS}")[1]
    md = plane.request("GET", f"/apis/kvfleet.io/v1alpha1/namespaces/{ns}/modeldeployments/{MD}")[1]
    pods = {
        n: (
            p["spec"].get("nodeName"),
            p["status"].get("phase"),
            p["metadata"].get("deletionTimestamp"),
            [(c["type"], c["status"]) for c in p["status"].get("conditions") or []],
        )
        for n, p in _engine_pods(plane, ns).items()
    }
    nodes = {
        n["metadata"]["name"]: (_ready_status(n), [t["key"] for t in n["spec"].get("taints") or []])
        for n in get(plane, "/api/v1/nodes")["items"]
    }
    kcm = plane.workdir / "logs" / "kube-controller-manager.log"
    lifecycle = [
        line
        for line in kcm.read_text(errors="replace").splitlines()
        if "node_lifecycle" in line or "taint" in line
    ]
    return (
        f"nodes: {nodes}\nnode lifecycle log:\n" + "\n".join(lifecycle[-30:]) + "\n"
        f"statefulset status: {(sts or {}).get('status')}\nmodeldeployment status: {(md or {}).get('status')}"
        f"\nengine pods: {pods}\noperator log:\n{scene.operator.log()[-4000:]}"
    )


def test_a_lost_node_s_engine_pod_is_replaced_and_the_gateway_s_view_follows(scene: Scene) -> None:
    try:
        _lose_a_node(scene)
    except AssertionError as failed:
        raise AssertionError(f"{failed}\n{_diagnosis(scene)}") from failed


def _lose_a_node(scene: Scene) -> None:
    plane, ns = scene.plane, scene.namespace

    def both_running() -> dict[str, dict[str, Any]] | None:
        pods = _engine_pods(plane, ns)
        return pods if len(pods) == 2 and all(_running_ready(p) for p in pods.values()) else None

    pods = wait_for(both_running, timeout=120, interval=0.5, what="both engine pods Running")
    config = f"/api/v1/namespaces/{ns}/configmaps/{config_map_name(MD)}"
    wait_for(lambda: plane.request("GET", config)[0] == 200, timeout=60, what="the tenant table")
    wait_for(lambda: _md_ready_replicas(plane, ns) == 2, timeout=60, what="readyReplicas 2")
    (doomed,) = [name for name, p in pods.items() if p["spec"]["nodeName"] == LOST]
    old_uid = pods[doomed]["metadata"]["uid"]
    (survivor,) = [name for name in pods if name != doomed]
    wait_for(lambda: doomed in _ready_endpoints(plane, ns), timeout=30, what="the doomed pod an endpoint")
    # What the API server put on the pod: the operator's 30 s, not DefaultTolerationSeconds' 300 s.
    tolerations = {t["key"]: t.get("tolerationSeconds") for t in pods[doomed]["spec"]["tolerations"]}
    assert tolerations[UNREACHABLE] == NODE_LOSS_TOLERATION_SECONDS, tolerations
    table = _tenant_table(plane, ns)
    status, body = plane.request("POST", "/api/v1/nodes", _gpu_node(SPARE))
    assert status == 201, body
    wait_for(lambda: _schedulable(plane, SPARE), timeout=60, what=f"{SPARE} Ready")

    scene.kubelet.stop(timeout=0)  # SIGTERM then at once SIGKILL: the node's kubelet is gone
    t = Timeline()

    def lost_and_tainted() -> bool:
        node = _node(plane, LOST)
        taints = node.get("spec", {}).get("taints") or []
        return _ready_status(node) == "Unknown" and any(
            x["key"] == UNREACHABLE and x["effect"] == "NoExecute" for x in taints
        )

    wait_for(lost_and_tainted, timeout=GRACE_PERIOD_S + 60, interval=0.5, what="the node unreachable")
    t.mark("node_unreachable_tainted")
    wait_for(
        lambda: doomed not in _ready_endpoints(plane, ns),
        timeout=30,
        what="the lost pod out of the endpoints",
    )
    t.mark("out_of_endpoints")
    assert survivor in _ready_endpoints(plane, ns)  # the replica on a healthy node serves on
    wait_for(lambda: _md_ready_replicas(plane, ns) == 1, timeout=60, what="readyReplicas 1")
    t.mark("md_ready_replicas_1")
    wait_for(
        lambda: _engine_pods(plane, ns)[doomed]["metadata"].get("deletionTimestamp"),
        timeout=NODE_LOSS_TOLERATION_SECONDS + 60,
        interval=0.5,
        what="the lost pod evicted",
    )
    evicted = t.mark("evicted")
    taint_to_eviction = evicted - t.steps["node_unreachable_tainted"]
    # The taint manager waits for the pod's toleration (30 s) from the taint, not the API server's 300 s.
    assert NODE_LOSS_TOLERATION_SECONDS - 5 <= taint_to_eviction <= NODE_LOSS_TOLERATION_SECONDS + 30, t.steps
    # What the real API server shows on the evicted pod: what reconcile/node_loss.py recognises.
    evicted_pod = _engine_pods(plane, ns)[doomed]
    disruption = next(c for c in evicted_pod["status"]["conditions"] if c["type"] == DISRUPTION_TARGET)
    assert (disruption["status"], disruption["reason"]) == ("True", DELETION_BY_TAINT_MANAGER), disruption
    assert evicted_from_lost_node(evicted_pod, None), evicted_pod["status"]
    grace_s = int(evicted_pod["metadata"]["deletionGracePeriodSeconds"])
    deletion = _parse_time(evicted_pod["metadata"]["deletionTimestamp"])
    # Nobody confirms the pod stopped: until its grace period plus nodeLoss.after ran out it stays,
    # Terminating, and no second pod of its name starts.
    time.sleep(5)
    still = _engine_pods(plane, ns)[doomed]
    assert still["metadata"]["uid"] == old_uid and still["metadata"].get("deletionTimestamp")

    def old_pod_gone() -> bool:
        pod = _engine_pods(plane, ns).get(doomed)
        return pod is None or pod["metadata"]["uid"] != old_uid

    if not scene.replace:
        # At-most-one kept: past the grace period, nodeLoss.after and two resyncs the pod is still there...
        past_due = deletion + timedelta(seconds=NODE_LOSS_AFTER_S + 2 * scene.operator.resync_seconds)
        wait_for(lambda: datetime.now(UTC) >= past_due, timeout=grace_s + 60, what="past the replace time")
        still = _engine_pods(plane, ns)[doomed]
        assert still["metadata"]["uid"] == old_uid and still["metadata"].get("deletionTimestamp")
        t.mark("still_terminating_past_due")
        # ... until the node is confirmed shut down (non-graceful node shutdown).
        node = _node(plane, LOST)
        taint = {"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"}
        node["spec"]["taints"] = [*(node["spec"].get("taints") or []), taint]
        status, body = plane.request("PUT", f"/api/v1/nodes/{LOST}", node)
        assert status == 200, body
        t.mark("out_of_service")
    wait_for(
        old_pod_gone, timeout=grace_s + NODE_LOSS_AFTER_S + 60, interval=0.5, what="the lost pod deleted"
    )
    t.mark("force_deleted")

    def replaced() -> dict[str, Any] | None:
        pod = _engine_pods(plane, ns).get(doomed)
        return pod if pod and pod["metadata"]["uid"] != old_uid and _running_ready(pod) else None

    new = wait_for(replaced, timeout=90, interval=0.5, what="the replacement Running")
    t.mark("replacement_running")
    assert new["spec"]["nodeName"] == SPARE
    # Not before the grace period plus nodeLoss.after (the API server's clock, second resolution).
    created = _parse_time(new["metadata"]["creationTimestamp"])
    assert created >= deletion + timedelta(seconds=NODE_LOSS_AFTER_S - 1), (created, deletion)
    # With replace on nobody confirmed the node down: the operator did it. Either way it said what it did
    # (or why not) on the ModelDeployment, once.
    taints = [x["key"] for x in _node(plane, LOST)["spec"].get("taints") or []]
    assert (OUT_OF_SERVICE in taints) is not scene.replace and UNREACHABLE in taints, taints
    events = get(plane, f"/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name={MD}")["items"]
    told = [(e["reason"], e["message"]) for e in events if e["reason"] in (ENGINE_POD_REPLACED, STUCK)]
    assert [r for r, _ in told] == [ENGINE_POD_REPLACED if scene.replace else STUCK], told
    assert doomed in told[0][1] and LOST in told[0][1], told
    new_uid = new["metadata"]["uid"]
    wait_for(
        lambda: _ready_endpoints(plane, ns).get(doomed) == new_uid, timeout=30, what="the new pod an endpoint"
    )
    t.mark("endpoint_is_the_new_pod")
    wait_for(lambda: _md_ready_replicas(plane, ns) == 2, timeout=60, what="readyReplicas 2 again")
    t.mark("md_ready_replicas_2")
    assert _engine_pods(plane, ns)[survivor]["metadata"]["uid"] == pods[survivor]["metadata"]["uid"]
    # The tenant table names the replicas by their stable names: the same table serves the new pod.
    assert _tenant_table(plane, ns) == table
    assert f"http://{doomed}.{STS}.{ns}.svc" in json.dumps(table)
    assert scene.operator.running(), scene.operator.log()[-3000:]
    print(
        f"\nnode loss timeline, nodeLoss.replace {scene.replace} (s from the kubelet's death; node grace "
        f"period {GRACE_PERIOD_S} s, pod "
        f"toleration {NODE_LOSS_TOLERATION_SECONDS} s, pod grace period {grace_s} s, nodeLoss.after "
        f"{NODE_LOSS_AFTER_S} s, operator resync {scene.operator.resync_seconds:g} s):",
        t.steps,
    )
