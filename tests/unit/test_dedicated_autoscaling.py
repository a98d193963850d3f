"""Dedicated pools autoscale within their GPU group's nodes (``Tenant.spec.dedicated.autoscaling``): the
ScaledObject build/autoscaling.py renders per autoscaled tenant, the group's capacity
(reconcile/group_capacity.py) that clamps it and the StatefulSet, the conditions that say why autoscaling
does not work as asked, and the Tenant's scale subresource in its status. Real KEDA scaling a Tenant is
tests/cluster/test_keda_dedicated_autoscaling.py."""

from __future__ import annotations

import copy
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfleet_operator.api import ModelDeployment, Tenant, reasons
from kvfleet_operator.api.tenant import RULE_DEDICATED_AUTOSCALING_BOUNDS, DedicatedAutoscaling
from kvfleet_operator.build import autoscaling as build
from kvfleet_operator.build.autoscaling import DedicatedScaling, GroupCapacity
from kvfleet_operator.build.common import owner_of
from kvfleet_operator.build.model_deployment import (
    OperatorImages,
    build_desired_children,
    dedicated_pod_spec,
)
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile.group_capacity import (
    compute_group_capacity,
    plan_dedicated_scaling,
    pod_requests,
    replicas_by_tenant,
    replicas_on_node,
)
from kvfleet_runtime.config import KeyFile
from kvfleet_runtime.gateway import metrics as gateway_metrics

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
IMAGES = OperatorImages(engine="engine:default", gateway="gateway:default")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
NOW = "2026-12-01T00:00:00Z"
PROM = "http://prometheus-operated.monitoring:9090"
GROUP = "bank-h200"
POOL = "dedicated-bank"


def _qwen(autoscaling: dict[str, Any] | None = None) -> ModelDeployment:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "modeldeployment-qwen72b.yaml").read_text())
    doc["metadata"].update(namespace="llm", uid="md-uid", generation=1)
    if autoscaling is not None:
        doc["spec"]["pool"]["autoscaling"] = autoscaling
    return ModelDeployment.model_validate(doc)


def _bank(autoscaling: dict[str, Any] | None = None, tier: str = "premium", replicas: int = 1) -> Tenant:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "tenant-bank.yaml").read_text())
    doc["metadata"].update(uid="bank-uid", generation=1)
    doc["spec"]["tier"] = tier
    doc["spec"]["dedicated"]["replicas"] = replicas
    if autoscaling is not None:
        doc["spec"]["dedicated"]["autoscaling"] = autoscaling
    return Tenant.model_validate(doc)


ON = {"enabled": True, "minReplicas": 1, "maxReplicas": 4}
#: The ModelDeployment names the Prometheus; its own pool does not autoscale.
MD_PROM = {"prometheusAddress": PROM, "pollingIntervalSeconds": 5}


def _node(
    name: str,
    group: str | None = GROUP,
    gpus: int = 8,
    memory: str = "512Gi",
    *,
    ready: bool = True,
    cordoned: bool = False,
    product: str = "NVIDIA-H200",
) -> dict[str, Any]:
    """A node as the API server lists it, like the devcluster's kwok GPU nodes (hack/devcluster/layout.py)."""
    labels = {"nvidia.com/gpu.product": product}
    taints = []
    if group is not None:
        labels["kvfleet.io/gpu-group"] = group
        taints.append({"key": "kvfleet.io/gpu-group", "value": group, "effect": "NoSchedule"})
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints, **({"unschedulable": True} if cordoned else {})},
        "status": {
            "allocatable": {"cpu": "64", "memory": memory, "nvidia.com/gpu": str(gpus), "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def _pod(md: ModelDeployment | None = None, tenant: Tenant | None = None) -> dict[str, Any]:
    return dedicated_pod_spec(md or _qwen(MD_PROM), tenant or _bank(ON), POOL, IMAGES)


# --- the API ----------------------------------------------------------------------------------------------


def test_autoscaling_is_off_by_default_and_its_bounds_are_checked() -> None:
    dedicated = _bank().spec.dedicated
    assert dedicated is not None and dedicated.autoscaling == DedicatedAutoscaling()
    assert not DedicatedAutoscaling().enabled
    with pytest.raises(ValidationError, match=r"minReplicas <= maxReplicas"):
        _bank({"enabled": True, "minReplicas": 3, "maxReplicas": 2})
    assert "minReplicas" in RULE_DEDICATED_AUTOSCALING_BOUNDS.rule


# --- the group's capacity ---------------------------------------------------------------------------------


def test_what_one_replica_asks_of_a_node_counts_an_init_container_only_where_it_asks_more() -> None:
    pod = {
        "containers": [
            {"resources": {"requests": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "2"}}},
            {"resources": {"requests": {"cpu": "500m"}}},
        ],
        "initContainers": [{"resources": {"requests": {"cpu": "4", "memory": "512Mi"}}}],
    }
    requests = pod_requests(pod)
    assert requests == {"cpu": Decimal(4), "memory": Decimal(1 << 30), "nvidia.com/gpu": Decimal(2)}


def test_a_kwok_group_of_two_eight_gpu_nodes_holds_two_eight_gpu_replicas() -> None:
    pod = _pod()
    assert pod_requests(pod)["nvidia.com/gpu"] == 8  # qwen72b: tensorParallelSize 8
    nodes = [_node("g-0"), _node("g-1")]
    capacity = compute_group_capacity(GROUP, pod, nodes, "nvidia.com/gpu", 8)
    assert capacity == GroupCapacity(GROUP, 2, 2, 16, "nvidia.com/gpu", 8)
    assert capacity.describe() == (
        "GPU group bank-h200 holds 2 replica(s) (2 schedulable node(s), 16 nvidia.com/gpu at 8 per replica)"
    )


def test_only_the_groups_ready_uncordoned_nodes_that_fit_the_pod_count() -> None:
    pod = _pod()
    nodes = [
        _node("g-0"),
        _node("g-1", ready=False),
        _node("g-2", cordoned=True),
        _node("g-3", product="NVIDIA-L4"),  # the pool's gpuType selects H200s
        _node("g-4", gpus=4),  # fewer GPUs than one replica asks
        _node("other", group="other-group"),
        _node("shared", group=None),
    ]
    capacity = compute_group_capacity(GROUP, pod, nodes, "nvidia.com/gpu", 8)
    assert (capacity.replicas, capacity.nodes, capacity.gpus) == (1, 1, 8)
    assert [replicas_on_node(pod, n) for n in nodes] == [1, 0, 0, 0, 0, 0, 0]


def test_the_scarcest_request_decides_memory_as_well_as_gpus() -> None:
    """qwen72b's replica asks 288Gi (its LMCache CPU tier): a 16-GPU node with 512Gi holds one, not two."""
    pod = _pod()
    assert replicas_on_node(pod, _node("big", gpus=16)) == 1
    assert replicas_on_node(pod, _node("big", gpus=16, memory="1Ti")) == 2


def test_a_cpu_engine_is_counted_by_its_cpu_and_memory_requests() -> None:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "modeldeployment-qwen72b.yaml").read_text())
    doc["metadata"]["namespace"] = "llm"
    doc["spec"]["model"]["architecture"] = {"preset": "tiny-llama"}
    doc["spec"]["engine"] = {}
    doc["spec"]["kvCache"] = {"cpuSize": "0"}
    doc["spec"]["pool"] = {"gpusPerReplica": 0, "cpuKvCacheSpace": "1Gi", "replicas": 1}
    cpu = ModelDeployment.model_validate(doc)
    pod = _pod(cpu)
    requests = pod_requests(pod)
    assert "nvidia.com/gpu" not in requests
    node = _node("cpu-0", gpus=0, memory="20Gi")
    held = replicas_on_node(pod, node)
    assert held == min(64 // int(requests["cpu"]), (20 << 30) // int(requests["memory"]))
    assert held >= 1
    capacity = compute_group_capacity(GROUP, pod, [node], "nvidia.com/gpu", 0)
    assert capacity.replicas == held and "CPU engines" in capacity.describe()


# --- the bounds -------------------------------------------------------------------------------------------


def test_max_replicas_is_clamped_to_the_group_and_min_within_it() -> None:
    two = GroupCapacity(GROUP, 2, 2, 16, "nvidia.com/gpu", 8)
    bounds = DedicatedScaling(3, 4, two)
    assert (bounds.min_replicas, bounds.max_replicas) == (2, 2)
    assert [bounds.replicas(n) for n in (1, 2, 3, 9)] == [1, 2, 2, 2]
    note = bounds.clamped("bank")
    assert note is not None
    assert "maxReplicas is 4" in note and "GPU group bank-h200 holds 2 replica(s)" in note
    assert "16 nvidia.com/gpu at 8 per replica" in note and "kvfleet.io/gpu-group=bank-h200" in note
    roomy = DedicatedScaling(1, 2, two)
    assert roomy.clamped("bank") is None and roomy.max_replicas == 2
    # Unknown capacity (no right to list nodes): nothing is clamped.
    unknown = DedicatedScaling(1, 4, None)
    assert unknown.max_replicas == 4 and unknown.clamped("bank") is None
    # A group holding none: KEDA and the HPA still need a maximum of 1; the note says so.
    empty = DedicatedScaling(1, 4, GroupCapacity(GROUP, 0, 0, 0, "nvidia.com/gpu", 8))
    assert empty.max_replicas == 1 and "holds 0 replica(s)" in (empty.clamped("bank") or "")


# --- the ScaledObject -------------------------------------------------------------------------------------


def _scaled(md: ModelDeployment, tenant: Tenant, bounds: DedicatedScaling | None = None) -> dict[str, Any]:
    obj = build.build_dedicated_scaled_object(
        md, tenant, POOL, owner_of(tenant), bounds or DedicatedScaling(1, 4, None)
    )
    assert obj is not None
    return obj


def test_the_scaled_object_drives_the_tenants_scale_subresource_and_is_the_tenants() -> None:
    tenant = _bank(ON)
    two = GroupCapacity(GROUP, 2, 2, 16, "nvidia.com/gpu", 8)
    obj = _scaled(_qwen(MD_PROM), tenant, DedicatedScaling(1, 4, two))
    assert (obj["apiVersion"], obj["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert obj["metadata"]["name"] == "qwen72b-dedicated-bank-engine"
    assert obj["metadata"]["ownerReferences"] == [owner_of(tenant).reference()]
    assert obj["metadata"]["labels"]["kvfleet.io/pool"] == POOL
    spec = obj["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "kvfleet.io/v1alpha1", "kind": "Tenant", "name": "bank"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"]) == (1, 2, 5)
    assert {t["metadata"]["serverAddress"] for t in spec["triggers"]} == {PROM}


def test_the_triggers_read_this_pools_series_only_in_the_tenants_tier() -> None:
    md = _qwen({**MD_PROM, "signals": {"queuePerReplica": {"premium": 3}, "ttft": {"p99Seconds": 0.5}}})
    by_name = {t["name"]: t for t in _scaled(md, _bank(ON))["spec"]["triggers"]}
    assert list(by_name) == ["queue-premium", "kv-usage", "ttft-premium"]
    queue = by_name["queue-premium"]
    assert (queue["metricType"], queue["metadata"]["threshold"]) == ("AverageValue", "3")
    assert queue["metadata"]["query"] == (
        'sum(kvfleet_gateway_engine_queue_depth{namespace="llm",pod=~"(qwen72b-gateway|qwen72b-epp)-.+",'
        'pool="dedicated-bank",sla_tier="premium"}) or vector(0)'
    )
    kv = by_name["kv-usage"]["metadata"]["query"]
    assert 'pod=~"qwen72b-dedicated-bank-engine-[0-9]+"' in kv and "qwen72b-engine-" not in kv
    ttft = by_name["ttft-premium"]["metadata"]["query"]
    assert 'tenant="bank"' in ttft and by_name["ttft-premium"]["metadata"]["threshold"] == "0.5"
    assert build.TENANT_LABEL == "tenant"  # the gateway's latency label (a runtime name, not importable)
    assert "tenant" in gateway_metrics.GatewayMetrics().ttft.labelnames


def test_a_basic_dedicated_tenant_is_not_capped_and_a_ttft_objective_of_another_tier_does_not_apply() -> None:
    md = _qwen({**MD_PROM, "signals": {"ttft": {"tier": "premium", "p99Seconds": 0.5}}})
    triggers = _scaled(md, _bank(ON, tier="basic"))["spec"]["triggers"]
    assert [t["name"] for t in triggers] == ["queue-basic", "kv-usage"]
    assert "clamp_max" not in triggers[0]["metadata"]["query"] and triggers[0]["metadata"]["threshold"] == "8"


def test_no_scaled_object_without_autoscaling_or_without_the_model_deployments_prometheus() -> None:
    bounds = DedicatedScaling(1, 4, None)
    md = _qwen(MD_PROM)
    assert build.build_dedicated_scaled_object(md, _bank(), POOL, owner_of(_bank()), bounds) is None
    bare = _qwen()
    assert build.build_dedicated_scaled_object(bare, _bank(ON), POOL, owner_of(_bank(ON)), bounds) is None
    why = build.dedicated_scaling_unavailable(bare, _bank(ON))
    assert why is not None and "spec.pool.autoscaling.prometheusAddress" in why and "qwen72b" in why
    assert build.dedicated_scaling_unavailable(md, _bank(ON)) is None


# --- what the reconcile decides ---------------------------------------------------------------------------


def _plan(
    md: ModelDeployment,
    tenant: Tenant,
    nodes: list[dict[str, Any]] | None,
    *,
    managed: bool = True,
    served: bool = True,
) -> tuple[dict[str, DedicatedScaling], dict[str, Any]]:
    return plan_dedicated_scaling(md, [(tenant, _pod(md, tenant))], nodes, managed=managed, served=served)


GROUP_NODES = [_node("g-0"), _node("g-1")]


@pytest.mark.parametrize(
    ("md", "nodes", "managed", "served", "reason", "says"),
    [
        pytest.param(
            _qwen(),
            GROUP_NODES,
            True,
            True,
            reasons.AUTOSCALING_UNAVAILABLE,
            "sets no spec.pool.autoscaling.prometheusAddress",
            id="no-prometheus",
        ),
        pytest.param(
            _qwen(MD_PROM),
            GROUP_NODES,
            False,
            True,
            reasons.AUTOSCALING_UNAVAILABLE,
            "rbac.keda=true",
            id="rbac",
        ),
        pytest.param(
            _qwen(MD_PROM),
            GROUP_NODES,
            True,
            False,
            reasons.AUTOSCALING_UNAVAILABLE,
            "install KEDA",
            id="keda",
        ),
        pytest.param(
            _qwen(MD_PROM), None, True, True, reasons.GROUP_CAPACITY_UNKNOWN, "rbac.readNodes", id="no-nodes"
        ),
        pytest.param(
            _qwen(MD_PROM),
            GROUP_NODES,
            True,
            True,
            reasons.MAX_REPLICAS_CLAMPED,
            "GPU group bank-h200 holds 2 replica(s)",
            id="clamped",
        ),
    ],
)
def test_the_tenant_says_why_autoscaling_does_not_work_as_asked(
    md: ModelDeployment,
    nodes: list[dict[str, Any]] | None,
    managed: bool,
    served: bool,
    reason: str,
    says: str,
) -> None:
    scaling, notes = _plan(md, _bank(ON), nodes, managed=managed, served=served)
    note = notes["bank"]
    assert (note.type, note.status, note.reason) == ("Degraded", "True", reason)
    assert says in note.message, note.message
    assert scaling["bank"].max_replicas == (4 if nodes is None else 2)


def test_within_the_group_nothing_is_said_and_tenants_without_autoscaling_are_left_alone() -> None:
    scaling, notes = _plan(_qwen(MD_PROM), _bank({**ON, "maxReplicas": 2}), GROUP_NODES)
    assert notes == {} and scaling["bank"].max_replicas == 2
    assert _plan(_qwen(MD_PROM), _bank(), GROUP_NODES) == ({}, {})


def _children(
    md: ModelDeployment, tenant: Tenant, scaling: dict[str, DedicatedScaling] | None = None
) -> list[dict[str, Any]]:
    capacity = compute_pool_capacity(md)
    decisions = admit_tenants(capacity, [tenant])
    return build_desired_children(md, capacity, [tenant], decisions, KEYS, IMAGES, dedicated_scaling=scaling)


def _pool(children: list[dict[str, Any]]) -> dict[str, Any]:
    name = "qwen72b-dedicated-bank-engine"
    (sts,) = [o for o in children if o["kind"] == "StatefulSet" and o["metadata"]["name"] == name]
    return sts


def test_the_statefulset_never_runs_more_than_the_group_holds_while_autoscaling_owns_its_replicas() -> None:
    md = _qwen(MD_PROM)
    tenant = _bank(ON, replicas=4)  # the HPA wrote 4 before a node left, or a hand edit
    scaling, _ = _plan(md, tenant, GROUP_NODES)
    children = _children(md, tenant, scaling)
    assert _pool(children)["spec"]["replicas"] == 2
    (scaled,) = [o for o in children if o["kind"] == "ScaledObject"]
    assert scaled["spec"]["maxReplicaCount"] == 2 and scaled["spec"]["scaleTargetRef"]["kind"] == "Tenant"
    assert scaled["metadata"]["ownerReferences"][0]["uid"] == "bank-uid"
    # The tenant table lists only the replicas that run (the gateways never route to a Pending one).
    table = yaml.safe_load(next(o for o in children if o["kind"] == "ConfigMap")["data"]["tenants.json"])
    assert len(table["pools"][POOL]["endpoints"]) == 2
    # Without autoscaling spec.dedicated.replicas runs as written, and nothing is handed to KEDA.
    plain = _children(md, _bank(replicas=4))
    assert _pool(plain)["spec"]["replicas"] == 4 and not [o for o in plain if o["kind"] == "ScaledObject"]


def test_the_tenants_scale_subresource_says_what_runs_and_which_pods() -> None:
    md = _qwen(MD_PROM)
    tenant = _bank(ON, replicas=4)
    scaling, _ = _plan(md, tenant, GROUP_NODES)
    capacity = compute_pool_capacity(md)
    decisions = admit_tenants(capacity, [tenant])
    raw = copy.deepcopy(tenant.model_dump(by_alias=True, mode="json"))
    writes = st.compute_served_statuses(
        {"metadata": {"name": "qwen72b", "namespace": "llm"}},
        md,
        capacity,
        decisions,
        None,
        "http://qwen72b-gateway.llm.svc:8000/v1",
        [],
        {"bank": raw},
        [tenant],
        {},
        NOW,
        dedicated_replicas=replicas_by_tenant([tenant], scaling),
    )
    status = next(w.status for w in writes if w.raw is raw)
    assert status["replicas"] == 2
    assert status["selector"] == (
        "app.kubernetes.io/name=kvfleet,app.kubernetes.io/instance=qwen72b,"
        "app.kubernetes.io/component=engine,kvfleet.io/pool=dedicated-bank"
    )
    assert replicas_by_tenant([tenant], {}) == {"bank": 4}
