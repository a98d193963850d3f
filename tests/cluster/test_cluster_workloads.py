"""Full-tier smoke tests: the real scheduler, controller manager and kwok's fake GPU nodes.

A GPU Deployment must be scheduled by kube-scheduler onto a kwok GPU node and become Ready (deployment and
replica-set controllers, kwok's pod stages); a pod without the dedicated group's toleration must never
land on it; deleting an owner must garbage-collect its children.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_helpers import scratch_namespace, wait_for
from devcluster import GPU_GROUP_LABEL, GPU_POOL_LABEL, GPU_RESOURCE, ControlPlane

PAUSE = "registry.k8s.io/pause:3.10"


@pytest.fixture
def namespace(full_cluster: ControlPlane) -> Iterator[str]:
    with scratch_namespace(full_cluster, "workloads", wait=True) as name:
        yield name


def _deployment(
    name: str, replicas: int, gpus: int = 0, pod_spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    if gpus:
        resources["limits"] = {GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [{"name": "engine", "image": PAUSE, "resources": resources}],
                    **(pod_spec or {}),
                },
            },
        },
    }


def _deployments(ns: str) -> str:
    return f"/apis/apps/v1/namespaces/{ns}/deployments"


def _wait_ready(plane: ControlPlane, ns: str, name: str, replicas: int) -> None:
    wait_for(
        lambda: _deployment_ready(plane, ns, name, replicas), timeout=120, what=f"Deployment {name} Ready"
    )


def _pods(plane: ControlPlane, ns: str, selector: str = "") -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"labelSelector": selector})
    status, body = plane.request("GET", f"/api/v1/namespaces/{ns}/pods?{query}")
    assert status == 200, body
    return list(body["items"])


def _deployment_ready(plane: ControlPlane, ns: str, name: str, replicas: int) -> bool:
    status, body = plane.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")
    return status == 200 and body.get("status", {}).get("readyReplicas", 0) == replicas


def test_nodes_of_the_layout_are_ready_with_gpus(full_cluster: ControlPlane) -> None:
    status, body = full_cluster.request("GET", "/api/v1/nodes")
    assert status == 200
    nodes = {n["metadata"]["name"]: n for n in body["items"]}
    for fake in full_cluster.layout.nodes:
        node = nodes[fake.name]
        assert node["status"]["allocatable"][GPU_RESOURCE] == str(fake.gpus)
        assert node["metadata"]["labels"].items() >= dict(fake.labels).items()
        taints = {(t["key"], t.get("value"), t["effect"]) for t in node["spec"].get("taints", [])}
        assert taints == {(t.key, t.value, t.effect) for t in fake.taints}


def test_gpu_deployment_is_scheduled_onto_a_kwok_gpu_node_and_ready(
    full_cluster: ControlPlane, namespace: str
) -> None:
    status, body = full_cluster.request("POST", _deployments(namespace), _deployment("engine", 2, gpus=4))
    assert status == 201, body
    _wait_ready(full_cluster, namespace, "engine", 2)
    shared = {n.name for n in full_cluster.layout.shared_pool}
    pods = _pods(full_cluster, namespace, "app=engine")
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["nodeName"] in shared
        assert pod["spec"]["schedulerName"] == "default-scheduler"
        conditions = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert conditions["PodScheduled"] == "True"
        assert conditions["Ready"] == "True"
        assert pod["status"]["phase"] == "Running"


def test_pod_without_the_dedicated_toleration_never_lands_on_the_dedicated_group(
    full_cluster: ControlPlane, namespace: str
) -> None:
    group, nodes = next(iter(full_cluster.layout.dedicated_groups.items()))
    dedicated = {n.name for n in nodes}
    selector = {"nodeSelector": {GPU_GROUP_LABEL: group}}
    toleration = {
        "tolerations": [{"key": GPU_GROUP_LABEL, "operator": "Equal", "value": group, "effect": "NoSchedule"}]
    }
    # More GPUs than the whole shared pool offers, without toleration: the overflow must stay Pending.
    shared_gpus = sum(n.gpus for n in full_cluster.layout.shared_pool)
    per_pod = full_cluster.layout.shared_pool[0].gpus
    overflow = shared_gpus // per_pod + 1
    for name, replicas, spec in (
        ("untolerated", 1, selector),
        ("tolerated", 1, {**selector, **toleration}),
        ("overflow", overflow, {}),
    ):
        gpus = per_pod if name == "overflow" else 1
        deployment = _deployment(name, replicas=replicas, gpus=gpus, pod_spec=spec)
        status, body = full_cluster.request("POST", _deployments(namespace), deployment)
        assert status == 201, body

    # Control: the same pod with the toleration does land on the dedicated group.
    _wait_ready(full_cluster, namespace, "tolerated", 1)
    assert _pods(full_cluster, namespace, "app=tolerated")[0]["spec"]["nodeName"] in dedicated

    def unschedulable(app: str) -> list[dict[str, Any]]:
        return [
            p
            for p in _pods(full_cluster, namespace, f"app={app}")
            for c in p["status"].get("conditions", [])
            if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable"
        ]

    pending = wait_for(lambda: unschedulable("untolerated"), timeout=60, what="untolerated pod Unschedulable")
    message = next(c["message"] for c in pending[0]["status"]["conditions"] if c["type"] == "PodScheduled")
    # The real scheduler's verdict: the group's nodes were filtered out by their taint.
    assert f"{len(dedicated)} node(s) had untolerated taint" in message, message
    _wait_ready(full_cluster, namespace, "overflow", overflow - 1)
    wait_for(lambda: unschedulable("overflow"), timeout=60, what="one overflow pod Unschedulable")
    for pod in _pods(full_cluster, namespace, "app in (untolerated,overflow)"):
        assert pod["spec"].get("nodeName") not in dedicated, pod["metadata"]["name"]
    placed = {p["spec"].get("nodeName") for p in _pods(full_cluster, namespace, "app=overflow")}
    assert placed - {None} <= {n.name for n in full_cluster.layout.shared_pool}
    assert any(GPU_POOL_LABEL in n.labels for n in full_cluster.layout.shared_pool)


def test_deleting_an_owner_garbage_collects_its_children(full_cluster: ControlPlane, namespace: str) -> None:
    cms = f"/api/v1/namespaces/{namespace}/configmaps"
    status, owner = full_cluster.request("POST", cms, {"metadata": {"name": "owner"}, "data": {"k": "v"}})
    assert status == 201, owner
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    child = {"metadata": {"name": "child", "ownerReferences": [ref]}, "data": {"k": "v"}}
    assert full_cluster.request("POST", cms, child)[0] == 201
    status, body = full_cluster.request("POST", _deployments(namespace), _deployment("gc", 2))
    assert status == 201, body
    _wait_ready(full_cluster, namespace, "gc", 2)
    assert len(_pods(full_cluster, namespace, "app=gc")) == 2

    # Background propagation: the owner goes at once, the garbage collector removes the children.
    delete = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
    assert full_cluster.request("DELETE", f"{cms}/owner", delete)[0] == 200
    assert full_cluster.request("DELETE", f"{_deployments(namespace)}/gc", delete)[0] == 200
    wait_for(lambda: full_cluster.request("GET", f"{cms}/child")[0] == 404, what="child ConfigMap GC")

    def replica_sets() -> list[Any]:
        path = f"/apis/apps/v1/namespaces/{namespace}/replicasets"
        return list(full_cluster.request("GET", path)[1]["items"])

    wait_for(lambda: not replica_sets(), timeout=60, what="ReplicaSets garbage-collected")
    wait_for(lambda: not _pods(full_cluster, namespace, "app=gc"), timeout=60, what="pods garbage-collected")
