"""Prerequisites as conditions on the real API server, scheduler and kwok nodes: a pool no node can run says
NoMatchingNodes, naming the selector and the missing label; the condition clears when a matching node
joins. The reconcile is the one every kopf handler calls (``reconcile_model_deployment``), in process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from cluster_helpers import scratch_namespace, unique_name, wait_for
from devcluster import GPU_POOL_LABEL, GPU_PRODUCT_LABEL, ControlPlane, FakeNode, Taint, build_node_manifest
from test_operator_reconcile import condition, create, get, load_example, reconcile

from kvfleet_operator.api import reasons

#: No node of the default layout carries this product label: the shared pool cannot be placed.
MISSING_PRODUCT = "NVIDIA-B200"


def _model_deployment(namespace: str, name: str) -> dict[str, Any]:
    doc = load_example("modeldeployment-qwen72b.yaml", namespace)
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["kvCache"].pop("nvme")  # no local volumes needed to tell a placement problem
    spec["pool"].update(replicas=1, gpuType=MISSING_PRODUCT, gpuMemory="180Gi")
    spec["pool"]["nodeSelector"] = {}
    return doc


@pytest.fixture
def namespace(full_cluster: ControlPlane) -> Iterator[str]:
    with scratch_namespace(full_cluster, "placement", crds=True) as ns:
        for plural in ("modeldeployments", "tenants"):
            # An Established CRD can still answer 429 "storage is (re)initializing" for a moment.
            path = f"/apis/kvfleet.io/v1alpha1/namespaces/{ns}/{plural}"
            wait_for(lambda path=path: full_cluster.request("GET", path)[0] == 200, what=f"{plural} served")
        yield ns


def _md(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    return get(plane, f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/modeldeployments/{name}")


def test_no_matching_node_is_a_condition_that_clears_when_one_joins(
    full_cluster: ControlPlane, namespace: str
) -> None:
    name = "b200"
    create(full_cluster, _model_deployment(namespace, name))
    reconcile(full_cluster, namespace, name)
    md = _md(full_cluster, namespace, name)
    ready, degraded = condition(md), condition(md, "Degraded")
    assert (ready["status"], ready["reason"]) == ("False", reasons.NO_MATCHING_NODES), ready
    assert (degraded["status"], degraded["reason"]) == ("True", reasons.NO_MATCHING_NODES)
    message = ready["message"]
    assert f"nodeSelector {GPU_POOL_LABEL}=shared, {GPU_PRODUCT_LABEL}={MISSING_PRODUCT}" in message
    n = len(get(full_cluster, "/api/v1/nodes")["items"])
    assert f"Of {n} node(s): {n} lack label {GPU_PRODUCT_LABEL}={MISSING_PRODUCT}" in message
    # The children are applied all the same: the pods wait, Pending, for a node.
    get(full_cluster, f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}-engine")

    node = FakeNode(
        name=unique_name("b200"),
        labels={GPU_POOL_LABEL: "shared", GPU_PRODUCT_LABEL: MISSING_PRODUCT},
        gpus=8,
        taints=(Taint("nvidia.com/gpu", "present", "NoSchedule"),),
    )
    status, body = full_cluster.request("POST", "/api/v1/nodes", build_node_manifest(node))
    assert status == 201, body
    try:
        # The node controller taints a new node not-ready until kwok reports it Ready; the matcher, like the
        # scheduler, waits for that. Each try is one level-triggered reconcile (the timer's job).
        def cleared() -> bool:
            reconcile(full_cluster, namespace, name)
            return bool(condition(_md(full_cluster, namespace, name))["reason"] != reasons.NO_MATCHING_NODES)

        wait_for(cleared, what="NoMatchingNodes to clear", interval=1.0)
        md = _md(full_cluster, namespace, name)
        assert condition(md, "Degraded")["status"] == "False"
    finally:
        full_cluster.request("DELETE", f"/api/v1/nodes/{node.name}")
