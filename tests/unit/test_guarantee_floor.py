"""The shared pool's guarantee floor (operator/kvfleet_operator/build/autoscaling.py): the replicas the
concurrency promised to the guaranteed tiers needs, the autoscaling minimum, the replicas the engine
StatefulSet never runs below, and the status that shows it. tests/cluster/test_keda_autoscaling.py proves
it through real KEDA and the HPA."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.api import ModelDeployment, Tenant, reasons
from kvfleet_operator.build.autoscaling import (
    DEFAULT_SEATS_PER_REPLICA,
    compute_guarantee_floor,
    seats_per_replica,
    shared_replicas,
)
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import TenantDecision, admit_tenants, compute_pool_capacity
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile.status import WorkloadReadiness
from kvfleet_runtime.config import KeyFile, TenantTable

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
IMAGES = OperatorImages(engine="engine:default", gateway="gateway:default")
KEYS = KeyFile(salt_key_hex="ab" * 32, key_hashes={})
NOW = "2026-12-01T00:00:00Z"
PROM = "http://prometheus-operated.monitoring:9090"
UP = WorkloadReadiness(wanted=1, ready=1)


def _doc(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    return doc


def _md(
    in_flight: int | None = 24, autoscaling: dict[str, Any] | None = None, **engine: Any
) -> ModelDeployment:
    doc = _doc("modeldeployment-qwen72b.yaml")
    doc["metadata"].update(namespace="team-a", uid="md-uid", generation=1)
    doc["spec"]["pool"]["replicas"] = 1
    if in_flight is not None:
        doc["spec"].setdefault("gateway", {})["engineInFlightPerReplica"] = in_flight
    doc["spec"].setdefault("engine", {}).update(engine)
    if autoscaling is not None:
        doc["spec"]["pool"]["autoscaling"] = autoscaling
    return ModelDeployment.model_validate(doc)


def _tenant(
    example: str, name: str | None = None, created: str = "2026-11-01T00:00:00Z", **spec: Any
) -> Tenant:
    doc = copy.deepcopy(_doc(example))
    doc["metadata"].update(namespace="team-a", uid=f"uid-{name or doc['metadata']['name']}")
    doc["metadata"]["creationTimestamp"] = created
    if name is not None:
        doc["metadata"]["name"] = name
    doc["spec"]["modelDeploymentRef"] = {"name": "qwen72b"}
    doc["spec"].update(spec)
    return Tenant.model_validate(doc)


def _admit(md: ModelDeployment, tenants: list[Tenant]) -> list[TenantDecision]:
    return admit_tenants(compute_pool_capacity(md), tenants)


#: standard on the shared pool with maxConcurrent 64; basic with 8; premium on its own GPU group with 128.
SAAS, STARTUP, BANK = "tenant-saas.yaml", "tenant-startup-a.yaml", "tenant-bank.yaml"


def test_only_admitted_guaranteed_tier_tenants_on_the_shared_pool_count() -> None:
    md = _md(in_flight=24)
    tenants = [_tenant(SAAS), _tenant(STARTUP), _tenant(BANK)]
    decisions = _admit(md, tenants)
    admitted = {d.name: d.pool for d in decisions if d.admitted}
    assert admitted["saas"] == "shared" and admitted["startup-a"] == "shared"
    floor = compute_guarantee_floor(md, tenants, decisions)
    # saas' 64 only: startup-a is best effort, the bank's 128 run on its own dedicated pool.
    assert (floor.seats, floor.per_replica, floor.replicas) == (64, 24, 3)
    # A premium tenant on the shared pool adds its seats; one that was not admitted adds none.
    premium = _tenant(SAAS, "gold", tier="premium", rateLimits={"maxConcurrent": 30})
    floor = compute_guarantee_floor(md, [*tenants, premium], _admit(md, [*tenants, premium]))
    assert (floor.seats, floor.replicas) == (94, 4)
    refused = [
        d if d.name != "gold" else TenantDecision("gold", False, "QuotaExceedsCapacity", "", "shared")
        for d in _admit(md, [*tenants, premium])
    ]
    assert compute_guarantee_floor(md, [*tenants, premium], refused).seats == 64
    # No tenant promised any seats: no floor.
    assert compute_guarantee_floor(md, [_tenant(STARTUP)], _admit(md, [_tenant(STARTUP)])).replicas == 0


@pytest.mark.parametrize(
    ("in_flight", "engine", "seats"),
    [
        pytest.param(24, {"maxNumSeqs": 64}, 24, id="the-gateways-in-flight-first"),
        pytest.param(0, {"maxNumSeqs": 64}, 64, id="no-gateway-limit-then-max-num-seqs"),
        pytest.param(None, {"maxNumSeqs": 64}, 64, id="unset-then-max-num-seqs"),
        pytest.param(None, {}, DEFAULT_SEATS_PER_REPLICA, id="else-vllms-default"),
    ],
)
def test_what_one_replica_seats(in_flight: int | None, engine: dict[str, Any], seats: int) -> None:
    assert seats_per_replica(_md(in_flight=in_flight, **engine)) == seats


def _children(md: ModelDeployment, tenants: list[Tenant]) -> dict[str, dict[str, Any]]:
    capacity = compute_pool_capacity(md)
    objs = build_desired_children(md, capacity, tenants, admit_tenants(capacity, tenants), KEYS, IMAGES)
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def _shared_endpoints(children: dict[str, dict[str, Any]]) -> int:
    table = TenantTable.model_validate_json(children["ConfigMap/qwen72b-tenants"]["data"]["tenants.json"])
    return len(table.pools["shared"].endpoints)


def test_with_autoscaling_the_floor_is_the_minimum_and_the_pool_never_runs_below_it() -> None:
    md = _md(in_flight=24, autoscaling={"enabled": True, "prometheusAddress": PROM, "maxReplicas": 6})
    children = _children(md, [_tenant(SAAS)])
    assert children["ScaledObject/qwen72b-engine"]["spec"]["minReplicaCount"] == 3
    # spec.pool.replicas still says 1 (the HPA has not acted yet): the StatefulSet runs the floor, and the
    # tenant table lists its three replicas.
    assert children["StatefulSet/qwen72b-engine"]["spec"]["replicas"] == 3
    assert _shared_endpoints(children) == 3
    # Without tenants promised seats: minReplicas, and spec.pool.replicas runs.
    bare = _children(md, [_tenant(STARTUP)])
    assert bare["ScaledObject/qwen72b-engine"]["spec"]["minReplicaCount"] == 1
    assert bare["StatefulSet/qwen72b-engine"]["spec"]["replicas"] == 1


def test_without_autoscaling_the_floor_is_reported_not_enforced() -> None:
    md = _md(in_flight=24)
    children = _children(md, [_tenant(SAAS)])
    assert "ScaledObject/qwen72b-engine" not in children
    assert children["StatefulSet/qwen72b-engine"]["spec"]["replicas"] == 1
    tenants = [_tenant(SAAS)]
    floor = compute_guarantee_floor(md, tenants, _admit(md, tenants))
    assert shared_replicas(md, floor) == 1
    status = st.compute_model_deployment_status(
        md, compute_pool_capacity(md), _admit(md, tenants), UP, UP, "http://x/v1", None, NOW, floor=floor
    )
    assert (status["guaranteed"]["seats"], status["guaranteed"]["replicas"]) == (64, 3)
    assert status["replicas"] == 1
    assert not [c for c in status["conditions"] if c["type"] == "Degraded" and c["status"] == "True"]


def test_a_floor_above_max_replicas_is_capped_and_said() -> None:
    md = _md(in_flight=24, autoscaling={"enabled": True, "prometheusAddress": PROM, "maxReplicas": 2})
    tenants = [_tenant(SAAS)]
    children = _children(md, tenants)
    assert children["ScaledObject/qwen72b-engine"]["spec"]["minReplicaCount"] == 2
    assert children["StatefulSet/qwen72b-engine"]["spec"]["replicas"] == 2
    floor = compute_guarantee_floor(md, tenants, _admit(md, tenants))
    status = st.compute_model_deployment_status(
        md, compute_pool_capacity(md), _admit(md, tenants), UP, UP, "http://x/v1", None, NOW, floor=floor
    )
    assert status["replicas"] == 2  # what runs, for the scale subresource
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == reasons.GUARANTEE_FLOOR_UNMET
    assert "spec.pool.autoscaling.maxReplicas is 2" in degraded["message"]
    # Within bounds: no condition.
    roomy = _md(in_flight=24, autoscaling={"enabled": True, "prometheusAddress": PROM, "maxReplicas": 3})
    floor = compute_guarantee_floor(roomy, tenants, _admit(roomy, tenants))
    assert floor.unmet(roomy.spec.pool.autoscaling) is None
