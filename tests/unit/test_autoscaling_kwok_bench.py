"""The kwok autoscaling benchmark's pure parts (``benchmarks/autoscaling_kwok.py``): what it creates is what
the product accepts and sizes as the phases expect, and how it reads its samples."""

from __future__ import annotations

import sys
from pathlib import Path

from devcluster import GPU_POOL_LABEL, build_node_manifest

from kvfleet_operator.api.modeldeployment import ModelDeployment
from kvfleet_operator.api.tenant import Tenant
from kvfleet_operator.build.autoscaling import GuaranteeFloor, build_triggers, seats_per_replica

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import autoscaling_kwok as bench  # a script, imported from its own folder

PROM = "http://127.0.0.1:9090"


def _sample(t: float, **kw: object) -> bench.Sample:
    fields: dict[str, object] = {
        "hpa_desired": 1,
        "hpa_min": 1,
        "spec_replicas": 1,
        "floor": 1,
        "sts_replicas": 1,
        "pods": 1,
        "pods_ready": 1,
        "pods_pending": 0,
    }
    fields.update(kw)
    return bench.Sample(t=t, **fields)  # type: ignore[arg-type]


def test_the_model_deployment_and_tenants_are_valid_and_sized_as_the_phases_assume() -> None:
    md = ModelDeployment.model_validate(bench.model_deployment("ns", PROM))
    autoscaling = md.spec.pool.autoscaling
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.best_effort_cap) == (1, 4, 2)
    assert md.spec.kv_cache.nvme is None  # kwok nodes have no local volumes
    assert md.spec.pool.gpus_per_replica == bench.GPUS_PER_NODE  # one replica per node
    assert seats_per_replica(md) == bench.SEATS_PER_REPLICA
    triggers = {t.name: t for t in build_triggers("ns", bench.MD, autoscaling)}
    # The best-effort queue is read clamped at the cap's worth: a burst of 16 asks for 2 replicas, not 4.
    assert triggers["queue-basic"].query.startswith("clamp_max(") and triggers["queue-basic"].query.endswith(
        f", {bench.BEST_EFFORT_CAP * bench.QUEUE_PER_REPLICA})"
    )
    assert bench.BURST // int(triggers["queue-premium"].target) == bench.MAX_REPLICAS
    for name, tier in (
        (bench.BASE_TENANT, "premium"),
        (bench.FLOOR_TENANT, "standard"),
        *bench.WAITING,
    ):
        parsed = Tenant.model_validate(bench.tenant("ns", name, tier))
        assert parsed.spec.rate_limits.max_concurrent == bench.SEATS_PER_REPLICA
    # Base + floor tenant: 48 seats at 24 per replica, a floor of 2; with the three waiting ones, 4.
    two = GuaranteeFloor(seats=2 * bench.SEATS_PER_REPLICA, per_replica=bench.SEATS_PER_REPLICA, replicas=2)
    assert two.minimum(autoscaling) == 2
    assert GuaranteeFloor(96, 24, 4).minimum(autoscaling) == bench.MAX_REPLICAS


def test_free_gpus_counts_what_pods_on_each_node_request() -> None:
    def node(name: str, gpus: int) -> dict[str, object]:
        return {"metadata": {"name": name}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}

    def pod(node_name: str | None, gpus: int, phase: str = "Running") -> dict[str, object]:
        container = {"resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}
        return {"spec": {"nodeName": node_name, "containers": [container]}, "status": {"phase": phase}}

    pods = [pod("a", 8), pod("b", 3), pod("b", 2, "Succeeded"), pod(None, 8, "Pending")]
    assert bench.free_gpus([node("a", 8), node("b", 8), node("c", 8)], pods) == {"a": 0, "b": 5, "c": 8}
    filler = bench.filler_pod("ns", "b", 5)
    assert filler["spec"]["nodeName"] == "b"
    assert filler["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "5"}


def test_an_arriving_node_joins_the_shared_pool_with_eight_gpus() -> None:
    manifest = build_node_manifest(bench.arriving_node("gpu-shared-arrive-0-1"))
    assert manifest["metadata"]["labels"][GPU_POOL_LABEL] == "shared"
    assert manifest["metadata"]["labels"]["kubernetes.io/hostname"] == "gpu-shared-arrive-0-1"
    assert manifest["status"]["allocatable"]["nvidia.com/gpu"] == "8"


def test_samples_are_read_from_a_moment_on() -> None:
    samples = [
        _sample(10.0),
        _sample(11.0, hpa_desired=4),
        _sample(12.0, hpa_desired=4, spec_replicas=4, tenants_ready={"t": False}),
        _sample(13.5, hpa_desired=4, spec_replicas=4, pods_ready=4, tenants_ready={"t": True}),
        _sample(14.0, spec_replicas=2, tenants_ready={"t": True}),
    ]
    assert bench.first_at(samples, 10.0, lambda s: (s.hpa_desired or 0) >= 4) == 1.0
    assert bench.first_at(samples, 10.0, bench.ready_at_least(4)) == 3.5
    assert bench.first_at(samples, 13.6, bench.ready_at_least(4)) is None
    assert bench.extreme(samples, 10.0, 14.0, lambda s: s.spec_replicas) == 4
    assert bench.extreme(samples, 13.0, 14.0, lambda s: s.spec_replicas, min) == 2
    assert bench.extreme(samples, 20.0, 30.0, lambda s: s.spec_replicas) is None
    # Not Ready from 12.0 (and unknown before: not Ready) until 13.5.
    assert bench.not_ready_seconds(samples, 10.0, 14.0, "t") == 3.5


def test_the_admission_order_follows_the_times_and_leaves_out_who_never_was() -> None:
    order = bench.admission_order({"a": 3.0, "b": 1.0, "c": None, "d": 2.0})
    assert order == ["b", "d", "a"]


def test_the_summary_reports_every_phase_over_the_rounds() -> None:
    p1 = {
        "to_hpa_s": 4.0,
        "to_spec_s": 4.2,
        "to_statefulset_s": 4.5,
        "to_ready_s": 6.0,
        "base_tenant_not_ready_s": 0.0,
        "scale_in_spec_s": 20.0,
        "scale_in_statefulset_s": 31.0,
    }
    p2 = {
        "max_hpa_desired": 2,
        "max_spec_replicas": 2,
        "max_statefulset_replicas": 2,
        "max_ready_pods": 2,
        "to_cap_s": 5.0,
        "basic_signal": 8.0,
        "window_s": 30.0,
    }
    p3 = {
        "min_hpa_desired": 2,
        "min_spec_replicas": 2,
        "min_statefulset_replicas": 2,
        "min_ready_pods": 2,
        "to_floor_spec_s": 19.0,
        "to_floor_statefulset_s": 30.0,
        "window_s": 45.0,
    }
    p4 = {
        "order": bench.EXPECTED_ORDER,
        "in_table_s": {"wait-premium": 3.0, "wait-standard-a": 2.5, "wait-standard-b": 2.0},
        "admitted_s": {"wait-premium": 2.9, "wait-standard-a": 2.4, "wait-standard-b": 1.9},
        "ready_after_last_node_s": {"wait-premium": 4.0, "wait-standard-a": 4.0, "wait-standard-b": 4.0},
        "nodes": [{"node_ready_s": 1.0, "pod_ready_s": 2.0}],
        "base_tenant_not_ready_s": 12.0,
    }
    rounds = [
        {"premium_burst": p1, "best_effort_burst": p2, "floor": p3, "pending": p4},
        {
            "premium_burst": {**p1, "to_ready_s": 8.0},
            "best_effort_burst": p2,
            "floor": p3,
            "pending": {**p4, "order": ["wait-standard-a"]},
        },
    ]
    figures = bench.summarize(rounds, 15, 10)
    ready = figures["premium_burst.to_ready_s"]
    assert (ready.median, ready.min, ready.max, ready.runs) == (7.0, 6.0, 8.0, 2)
    assert figures["best_effort_burst.max_spec_replicas"].max == 2
    assert figures["floor.min_spec_replicas"].min == 2
    assert figures["pending.rounds_in_expected_order"].median == 1
    assert figures["pending.in_table_s.wait-premium"].median == 3.0
    assert "drain 10 s" in figures["premium_burst.scale_in_statefulset_s"].note


def test_the_recorded_command_leaves_out_where_the_logs_went() -> None:
    argv = ["benchmarks/autoscaling_kwok.py", "--rounds", "3", "--keep-logs", "/somewhere", "--keep-logs=/x"]
    assert bench.without_keep_logs(argv) == ["benchmarks/autoscaling_kwok.py", "--rounds", "3"]
