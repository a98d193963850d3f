"""Scheduling prerequisites as conditions (reconcile/placement.py): the pure matcher on the pods the real
builders render from the examples, and the NoMatchingNodes condition it puts on the status."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.api import ModelDeployment, Tenant, reasons
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile import steps
from kvfleet_operator.reconcile.placement import compute_unmet
from kvfleet_runtime.config import KeyFile

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
IMAGES = OperatorImages(engine="engine:default", gateway="gateway:default")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
NOW = "2026-12-01T00:00:00Z"

#: A node that fits the qwen72b example's shared pool: GPU pool label, GFD product label, the GPU taint
#: the example tolerates, eight GPUs, and room for 288Gi (32Gi of its own + the 256Gi CPU tier).
H200: dict[str, Any] = {
    "metadata": {
        "name": "h200-1",
        "labels": {"kvfleet.io/gpu-pool": "shared", "nvidia.com/gpu.product": "NVIDIA-H200"},
    },
    "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
    "status": {"allocatable": {"cpu": "96", "memory": "2000Gi", "nvidia.com/gpu": "8", "pods": "110"}},
}


def _node(name: str, **changes: Any) -> dict[str, Any]:
    node = copy.deepcopy(H200)
    node["metadata"]["name"] = name
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        target = node
        for part in parents:
            target = target[part]
        if value is None:
            target.pop(leaf, None)
        else:
            target[leaf] = value
    return node


def _doc(name: str, **meta: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"].update(meta)
    return doc


def _qwen(**pool: Any) -> ModelDeployment:
    doc = _doc("modeldeployment-qwen72b.yaml", uid="md-uid", generation=1)
    doc["spec"]["pool"].update(pool)
    return ModelDeployment.model_validate(doc)


def _bank() -> Tenant:
    doc = _doc("tenant-bank.yaml", uid="uid-bank", generation=1, creationTimestamp="2026-01-01T00:00:00Z")
    return Tenant.model_validate(doc)


def _desired(md: ModelDeployment, tenants: list[Tenant] | None = None) -> tuple[list[dict[str, Any]], Any]:
    tenants = tenants or []
    capacity = compute_pool_capacity(md)
    decisions = admit_tenants(capacity, tenants)
    return build_desired_children(md, capacity, tenants, decisions, KEYS, IMAGES), decisions


def _shared_pod(md: ModelDeployment) -> dict[str, Any]:
    desired, _ = _desired(md)
    sts = next(o for o in desired if o["kind"] == "StatefulSet")
    pod: dict[str, Any] = sts["spec"]["template"]["spec"]
    return pod


def test_a_matching_node_fits() -> None:
    assert compute_unmet(_shared_pod(_qwen()), H200) == []
    desired, decisions = _desired(_qwen())
    assert steps.compute_placement(desired, [H200], decisions) == {}


@pytest.mark.parametrize(
    ("changes", "unmet"),
    [
        (
            {"metadata.labels": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
            "lack label kvfleet.io/gpu-pool=shared",
        ),
        (
            {"metadata.labels": {"kvfleet.io/gpu-pool": "shared", "nvidia.com/gpu.product": "NVIDIA-H100"}},
            "lack label nvidia.com/gpu.product=NVIDIA-H200",
        ),
        (
            {"spec.taints": [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]},
            "have taint dedicated=ml:NoSchedule not tolerated",
        ),
        ({"spec.unschedulable": True}, "are cordoned (unschedulable)"),
        ({"status.allocatable": {"cpu": "96", "memory": "2000Gi"}}, "have no nvidia.com/gpu"),
        (
            {"status.allocatable": {"cpu": "96", "memory": "2000Gi", "nvidia.com/gpu": "4"}},
            "have less nvidia.com/gpu than 8",
        ),
        # The 256Gi CPU tier is in the request: a node with 128Gi cannot take the pod.
        (
            {"status.allocatable": {"cpu": "96", "memory": "128Gi", "nvidia.com/gpu": "8"}},
            "have less memory than 288Gi",
        ),
    ],
)
def test_each_missing_prerequisite_is_named(changes: dict[str, Any], unmet: str) -> None:
    assert compute_unmet(_shared_pod(_qwen()), _node("n", **changes)) == [unmet]


def test_a_prefer_no_schedule_taint_does_not_block() -> None:
    node = _node("n", **{"spec.taints": [{"key": "spot", "effect": "PreferNoSchedule"}]})
    assert compute_unmet(_shared_pod(_qwen()), node) == []


def test_a_mig_pool_needs_the_mig_resource() -> None:
    pod = _shared_pod(_qwen(gpuResource="nvidia.com/mig-3g.71gb"))
    assert compute_unmet(pod, H200) == ["have no nvidia.com/mig-3g.71gb"]
    mig = _node(
        "mig", **{"status.allocatable": {"cpu": "96", "memory": "2000Gi", "nvidia.com/mig-3g.71gb": "8"}}
    )
    assert compute_unmet(pod, mig) == []


def test_the_message_names_the_selector_and_counts_the_nodes_lacking_each() -> None:
    nodes = [
        _node("cpu-1", **{"metadata.labels": {}, "status.allocatable": {"cpu": "8", "memory": "32Gi"}}),
        _node("cpu-2", **{"metadata.labels": {}, "status.allocatable": {"cpu": "8", "memory": "32Gi"}}),
        _node(
            "h100", **{"metadata.labels": {"kvfleet.io/gpu-pool": "shared", "nvidia.com/gpu.product": "H100"}}
        ),
    ]
    desired, decisions = _desired(_qwen())
    problems = steps.compute_placement(desired, nodes, decisions)
    message = problems["shared"]
    assert "pool 'shared' (StatefulSet qwen72b-engine)" in message
    assert "nodeSelector kvfleet.io/gpu-pool=shared, nvidia.com/gpu.product=NVIDIA-H200" in message
    assert "requests nvidia.com/gpu: 8" in message
    # Most common first, then alphabetical.
    assert (
        "Of 3 node(s): 3 lack label nvidia.com/gpu.product=NVIDIA-H200; 2 have less memory than 288Gi; "
        "2 have no nvidia.com/gpu; 2 lack label kvfleet.io/gpu-pool=shared." in message
    )
    assert "docs/operations.md, Prerequisites" in message


def test_no_nodes_at_all() -> None:
    desired, decisions = _desired(_qwen())
    assert "the cluster has no nodes" in steps.compute_placement(desired, [], decisions)["shared"]


def test_a_dedicated_group_with_no_nodes_is_named_with_its_tenant() -> None:
    desired, decisions = _desired(_qwen(), [_bank()])
    problems = steps.compute_placement(desired, [H200], decisions)
    assert "shared" not in problems  # the shared pool fits
    (pool,) = problems
    assert "Tenant 'bank''s dedicated pool" in problems[pool]
    assert "1 lack label kvfleet.io/gpu-group=bank-h200" in problems[pool]
    group_node = _node("bank-1")
    group_node["metadata"]["labels"] = {
        "kvfleet.io/gpu-group": "bank-h200",
        "nvidia.com/gpu.product": "NVIDIA-H200",
    }
    group_node["spec"]["taints"] = [
        {"key": "kvfleet.io/gpu-group", "value": "bank-h200", "effect": "NoSchedule"}
    ]
    assert steps.compute_placement(desired, [H200, group_node], decisions) == {}


def test_a_shared_pool_never_fits_a_dedicated_groups_node() -> None:
    """A group's node is tainted for its owner: the shared pool's pods are not placed there."""
    node = _node("bank-1")
    node["spec"]["taints"] = [{"key": "kvfleet.io/gpu-group", "value": "bank-h200", "effect": "NoSchedule"}]
    assert compute_unmet(_shared_pod(_qwen()), node) == [
        "have taint kvfleet.io/gpu-group=bank-h200:NoSchedule not tolerated"
    ]


def test_engines_waiting_only_lists_nodes_for_a_pool_that_is_not_ready() -> None:
    desired, _ = _desired(_qwen())
    sts = next(o for o in desired if o["kind"] == "StatefulSet")
    live = copy.deepcopy(sts)
    assert steps.engines_waiting(desired, [])  # not created yet
    live["status"] = {"readyReplicas": 1}
    assert steps.engines_waiting(desired, [live])
    live["status"] = {"readyReplicas": 2}
    assert not steps.engines_waiting(desired, [live])


def _ready_conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_the_model_deployment_says_no_matching_nodes_and_clears_when_a_node_fits() -> None:
    md = _qwen()
    capacity = compute_pool_capacity(md)
    waiting = st.WorkloadReadiness(wanted=2, ready=0)
    gateway = st.WorkloadReadiness(wanted=2, ready=2)
    desired, decisions = _desired(md)
    problem = steps.compute_placement(desired, [_node("cpu", **{"metadata.labels": {}})], decisions)["shared"]
    status = st.compute_model_deployment_status(
        md, capacity, [], waiting, gateway, "http://x", None, NOW, problem
    )
    assert _ready_conditions(status) == {
        "Ready": ("False", reasons.NO_MATCHING_NODES),
        "Progressing": ("True", reasons.NO_MATCHING_NODES),
        "Degraded": ("True", reasons.NO_MATCHING_NODES),
    }
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["message"] == problem
    # A matching node: no problem, the pods start; the condition goes back to waiting, then ready.
    md_with_status = md.model_copy(update={"status": md.status})
    status = st.compute_model_deployment_status(
        md_with_status, capacity, [], waiting, gateway, "http://x", None, NOW, None
    )
    assert _ready_conditions(status)["Ready"] == ("False", reasons.WAITING_FOR_REPLICAS)
    assert _ready_conditions(status)["Degraded"][0] == "False"
    # Once the engines are ready a stale placement message cannot hold the pool back.
    ready = st.WorkloadReadiness(wanted=2, ready=2)
    status = st.compute_model_deployment_status(
        md, capacity, [], ready, gateway, "http://x", None, NOW, problem
    )
    assert _ready_conditions(status)["Ready"] == ("True", reasons.READY)
