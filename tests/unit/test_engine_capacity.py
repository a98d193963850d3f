"""Planned vs reported KV capacity (reconcile/capacity.py): which pods are read, which figure admission
counts on, what the status says. The reader of the engines' figure against a local HTTP server:
tests/loopback/test_engine_capacity_reader.py; against a real vLLM-CPU engine:
tests/engine/test_engine_capacity_live.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.api import ModelDeployment, ModelDeploymentStatus, Tenant, reasons
from kvfleet_operator.api.modeldeployment import KvCapacityStatus
from kvfleet_operator.api.units import parse_quantity
from kvfleet_operator.build.common import PLUGIN_METRICS_PORT
from kvfleet_operator.build.tenant_table import admit_tenants, compute_pool_capacity
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile.capacity import (
    EngineCapacity,
    MetricsTarget,
    decide_engine_capacity,
    effective_capacity,
    engine_metrics_targets,
    explain_capacity_below_plan,
)
from kvfleet_operator.reconcile.status import WorkloadReadiness

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MIB = 1 << 20


def _doc(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"].update(namespace="ns", uid="md-uid", generation=1)
    return doc


def _md(name: str = "modeldeployment-qwen72b.yaml") -> ModelDeployment:
    return ModelDeployment.model_validate(_doc(name))


#: The ModelDeployment's engine StatefulSet (controlled by it), whose pods the operator reads.
POOL = {
    "metadata": {
        "name": "qwen72b-engine",
        "uid": "sts-uid",
        "ownerReferences": [
            {"kind": "ModelDeployment", "name": "qwen72b", "uid": "md-uid", "controller": True}
        ],
    }
}


def _controlled_by(kind: str, uid: str, controller: bool = True) -> list[dict[str, Any]]:
    return [{"apiVersion": "apps/v1", "kind": kind, "name": "x", "uid": uid, "controller": controller}]


def _pod(
    name: str,
    ip: str | None = "10.0.0.1",
    ready: bool = True,
    deleting: bool = False,
    owners: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "uid": f"uid-{name}",
        "ownerReferences": _controlled_by("StatefulSet", "sts-uid") if owners is None else owners,
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def _tenant(name: str, hbm: str | int, created: str) -> Tenant:
    return Tenant.model_validate(
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "Tenant",
            "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created, "generation": 1},
            "spec": {
                "modelDeploymentRef": {"name": "qwen"},
                "tier": "standard",
                "isolation": "salted",
                "kvQuota": {"hbm": hbm},
                "burstLimit": "90%",
                "apiKeySecretRef": {"name": f"{name}-key"},
            },
        }
    )


# --- which pods are read -------------------------------------------------------------------------------


def test_only_ready_pods_with_an_ip_that_stay_are_read() -> None:
    pods = [
        _pod("e-1"),
        _pod("e-0", ip="10.0.0.2"),
        _pod("starting", ready=False),
        _pod("no-ip", ip=None),
        _pod("leaving", deleting=True),
        _pod("v6", ip="fd00::7"),
    ]
    assert engine_metrics_targets(pods, [POOL], "md-uid") == [
        MetricsTarget("uid-e-0", "e-0", f"http://10.0.0.2:{PLUGIN_METRICS_PORT}/metrics"),
        MetricsTarget("uid-e-1", "e-1", f"http://10.0.0.1:{PLUGIN_METRICS_PORT}/metrics"),
        MetricsTarget("uid-v6", "v6", f"http://[fd00::7]:{PLUGIN_METRICS_PORT}/metrics"),
    ]


def test_only_pods_the_model_deployments_statefulsets_control_are_read() -> None:
    """Issue 23, hole 5: a Ready pod wearing the engine labels (the LIST's label selector matches it) but
    not created by the ModelDeployment's StatefulSet is never read: its figure (one block) would shrink the
    pool's capacity. Ownership is by UID: a look-alike StatefulSet of the same name that the
    ModelDeployment does not control, a non-controller reference, another kind, count for nothing."""
    foreign_pool = {
        "metadata": {
            "name": "qwen72b-engine",
            "uid": "other-sts",
            "ownerReferences": _controlled_by("ModelDeployment", "someone-else"),
        }
    }
    pods = [
        _pod("e-0"),
        _pod("impostor", owners=[]),
        _pod("adopted-by-reference", owners=_controlled_by("StatefulSet", "sts-uid", controller=False)),
        _pod("from-a-look-alike", owners=_controlled_by("StatefulSet", "other-sts")),
        _pod("from-a-replicaset", owners=_controlled_by("ReplicaSet", "sts-uid")),
    ]
    assert [t.pod for t in engine_metrics_targets(pods, [POOL, foreign_pool], "md-uid")] == ["e-0"]
    # Without the ModelDeployment's StatefulSets (or its UID) nothing is read: the estimate stands.
    assert engine_metrics_targets(pods, [foreign_pool], "md-uid") == []
    assert engine_metrics_targets(pods, [POOL], "") == []


# --- which figure admission counts on ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reported", "previous", "expect"),
    [
        ([], None, None),  # no engine has reported: the estimate
        ([900, 870, 910], None, 870),  # the fewest any replica holds
        ([1200], None, 1200),  # above the estimate: still the truth
        ([], KvCapacityStatus(planned_blocks=1000, reported_blocks=880), 880),  # none readable: kept
        ([], KvCapacityStatus(planned_blocks=1234, reported_blocks=880), None),  # estimate moved: dropped
        ([950], KvCapacityStatus(planned_blocks=1000, reported_blocks=880), 950),  # fresh figures win
    ],
)
def test_decide_engine_capacity(
    reported: list[int], previous: KvCapacityStatus | None, expect: int | None
) -> None:
    assert decide_engine_capacity(1000, reported, previous) == EngineCapacity(1000, expect)


def test_effective_capacity_replaces_the_hbm_figures_only() -> None:
    planned = compute_pool_capacity(_md())
    assert effective_capacity(planned, EngineCapacity(planned.hbm_blocks, None)) is planned
    reported = planned.hbm_blocks - 1000
    real = effective_capacity(planned, EngineCapacity(planned.hbm_blocks, reported))
    assert real.hbm_blocks == reported
    assert real.hbm_tokens == reported * planned.block_size
    assert real.hbm_bytes == reported * (planned.hbm_bytes // planned.hbm_blocks)
    assert (real.cpu_bytes, real.nvme_bytes, real.block_size) == (
        planned.cpu_bytes,
        planned.nvme_bytes,
        planned.block_size,
    )


def test_admission_resolves_quotas_against_the_reported_figure() -> None:
    """A share is a share of what vLLM allocated; a guarantee in tokens that fitted the estimate but not
    the real cache turns the youngest tenant away (as for any pool that shrinks)."""
    planned = compute_pool_capacity(_md())
    reported = planned.hbm_blocks * 3 // 4
    real = effective_capacity(planned, EngineCapacity(planned.hbm_blocks, reported))
    share = _tenant("share", "20%", "2026-01-01T00:00:00Z")
    tokens = (planned.hbm_blocks * 7 // 10) * planned.block_size  # 70% of the estimate, 93% of the real
    big = _tenant("big", tokens, "2026-01-02T00:00:00Z")
    on_plan = {d.name: d for d in admit_tenants(planned, [share, big])}
    assert on_plan["share"].admitted and on_plan["big"].admitted
    assert on_plan["share"].quota is not None and on_plan["share"].quota.hbm_blocks == planned.hbm_blocks // 5
    on_real = {d.name: d for d in admit_tenants(real, [share, big])}
    assert on_real["share"].quota is not None and on_real["share"].quota.hbm_blocks == reported // 5
    assert not on_real["big"].admitted
    assert on_real["big"].reason == reasons.QUOTA_EXCEEDS_CAPACITY
    assert f"of {reported} blocks per replica" in on_real["big"].message


# --- what a human is told ------------------------------------------------------------------------------


def test_no_note_unless_the_engines_hold_less_than_planned() -> None:
    md = _md()
    planned = compute_pool_capacity(md)
    for reported in (None, planned.hbm_blocks, planned.hbm_blocks + 10):
        engine = EngineCapacity(planned.hbm_blocks, reported)
        assert explain_capacity_below_plan(md, planned, engine, 0, 0) is None


def test_below_plan_names_the_reserve_that_makes_the_estimate_match() -> None:
    """The advice is checked by following it: with the reservePerGpu the message names, the planner's
    estimate is no longer above what vLLM allocated (and not far below it)."""
    doc = _doc("modeldeployment-qwen72b.yaml")
    md = ModelDeployment.model_validate(doc)
    planned = compute_pool_capacity(md)
    reported = planned.hbm_blocks - 1000
    engine = EngineCapacity(planned.hbm_blocks, reported)
    note = explain_capacity_below_plan(md, planned, engine, 4242, 2)
    assert note is not None
    assert f"vLLM allocated {reported} KV blocks per replica, 1000 fewer than the planner's" in note
    assert "4242 guaranteed" in note and "2 tenant(s) do not fit it" in note
    target = note.split("to about ")[1].split("Mi ")[0]
    assert parse_quantity(f"{target}Mi") > parse_quantity(md.spec.pool.reserve_per_gpu)
    doc["spec"]["pool"]["reservePerGpu"] = f"{target}Mi"
    followed = compute_pool_capacity(ModelDeployment.model_validate(doc))
    per_mib = (planned.hbm_bytes // planned.hbm_blocks) / (MIB * 8)  # MiB per block on each of 8 GPUs
    assert reported - 1 / per_mib - 1 <= followed.hbm_blocks <= reported


def test_below_plan_on_a_cpu_engine_points_at_quotas_or_kv_space() -> None:
    md = _md("local/modeldeployment-tiny.yaml")
    planned = compute_pool_capacity(md)
    note = explain_capacity_below_plan(md, planned, EngineCapacity(planned.hbm_blocks, 10), 0, 0)
    assert note is not None
    assert "cpuKvCacheSpace" in note and "reservePerGpu" not in note


def test_status_shows_both_figures_and_degrades_below_plan() -> None:
    md = _md()
    planned = compute_pool_capacity(md)
    engine = EngineCapacity(planned.hbm_blocks, planned.hbm_blocks - 1000)
    real = effective_capacity(planned, engine)
    note = explain_capacity_below_plan(md, planned, engine, 0, 0)
    up = WorkloadReadiness(wanted=1, ready=1)
    args: tuple[Any, ...] = (md, real, [], up, up, "http://gw/v1", None, "2026-03-01T00:00:00Z")
    status = st.compute_model_deployment_status(*args, engine=engine, capacity_note=note)
    kv = status["kvCapacity"]
    assert (kv["plannedBlocks"], kv["reportedBlocks"]) == (planned.hbm_blocks, planned.hbm_blocks - 1000)
    assert kv["perReplica"]["hbm"]["blocks"] == planned.hbm_blocks - 1000  # the figure admission used
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["Ready"]["status"] == "True"  # still serving
    assert (by_type["Degraded"]["status"], by_type["Degraded"]["reason"]) == ("True", "CapacityBelowPlan")
    assert by_type["Degraded"]["message"] == note
    # Converged: the same figures computed again over the status as written change nothing.
    raw = _doc("modeldeployment-qwen72b.yaml") | {"status": status}
    again = st.compute_model_deployment_status(
        ModelDeployment.model_validate(raw), *args[1:], engine=engine, capacity_note=note
    )
    assert not st.status_changed(status, again, ModelDeploymentStatus)
    # Before any engine reports: the estimate, no reportedBlocks, not degraded.
    fresh = st.compute_model_deployment_status(
        md, planned, [], up, up, "http://gw/v1", None, "2026-03-01T00:00:00Z", engine=EngineCapacity(10, None)
    )
    assert "reportedBlocks" not in fresh["kvCapacity"] and fresh["kvCapacity"]["plannedBlocks"] == 10
    assert {c["type"]: c["status"] for c in fresh["conditions"]}["Degraded"] == "False"
