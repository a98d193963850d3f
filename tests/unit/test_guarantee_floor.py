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
    admit_seats,
    compute_guarantee_floor,
    seats_per_replica,
    shared_replicas,
)
from kvfleet_operator.build.common import ANNOTATION_DRAIN
from kvfleet_operator.build.model_deployment import OperatorImages, build_desired_children
from kvfleet_operator.build.tenant_table import (
    TenantDecision,
    admit_tenants,
    compute_pool_capacity,
    requested_terms,
)
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile.drain import serving_ready_replicas
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


# --- Scale-out admits waiting tenants (build/autoscaling.admit_seats) --------------------------------


def _scaling(max_replicas: int = 4) -> ModelDeployment:
    auto = {"enabled": True, "prometheusAddress": PROM, "maxReplicas": max_replicas}
    return _md(in_flight=24, autoscaling=auto)


def _admitted_before(tenant: Tenant) -> Tenant:
    """``tenant`` as an earlier reconcile left it: admitted at its requested quota."""
    doc = tenant.model_dump(by_alias=True, mode="json", exclude_none=True)
    doc["status"] = {"admittedQuota": requested_terms(tenant).model_dump(by_alias=True, mode="json")}
    return Tenant.model_validate(doc)


def _seated(md: ModelDeployment, tenants: list[Tenant], ready: int) -> dict[str, TenantDecision]:
    return {d.name: d for d in admit_seats(md, tenants, _admit(md, tenants), ready)}


def test_a_new_guaranteed_tenant_waits_for_ready_replicas_and_its_seats_raise_the_floor() -> None:
    md = _scaling()
    tenants = [_tenant(SAAS), _tenant(STARTUP)]
    decided = _seated(md, tenants, ready=1)
    saas = decided["saas"]
    assert not saas.admitted and saas.reason == reasons.WAITING_FOR_CAPACITY
    assert saas.quota is None and saas.terms is None
    assert "its 64 concurrent requests" in saas.message and "need 3 ready replicas at 24" in saas.message
    assert "ready now: 1." in saas.message
    # Best effort promises no seats: admitted as before.
    assert decided["startup-a"].admitted
    floor = compute_guarantee_floor(md, tenants, list(decided.values()))
    assert (floor.seats, floor.waiting, floor.replicas) == (0, 64, 3)
    # The pool scales out for it: the StatefulSet and the ScaledObject's minimum; the table lists nobody
    # waiting.
    capacity = compute_pool_capacity(md)
    objs = build_desired_children(md, capacity, tenants, list(decided.values()), KEYS, IMAGES)
    children = {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}
    assert children["StatefulSet/qwen72b-engine"]["spec"]["replicas"] == 3
    assert children["ScaledObject/qwen72b-engine"]["spec"]["minReplicaCount"] == 3
    table = TenantTable.model_validate_json(children["ConfigMap/qwen72b-tenants"]["data"]["tenants.json"])
    assert set(table.tenants) == {"startup-a"}
    # Its status: progressing, not degraded, nothing admitted yet (so the next reconcile decides again).
    status = st.compute_tenant_status(tenants[0], saas, capacity, None, False, "http://x/v1", "k", NOW)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "False" and conditions["Ready"]["reason"] == "WaitingForCapacity"
    assert conditions["Progressing"]["status"] == "True" and conditions["Degraded"]["status"] == "False"
    assert "admittedQuota" not in status
    md_status = st.compute_model_deployment_status(
        md, capacity, list(decided.values()), UP, UP, "http://x/v1", None, NOW, floor=floor
    )
    assert md_status["guaranteed"]["waitingSeats"] == 64 and md_status["guaranteed"]["replicas"] == 3
    # Three ready replicas seat it: admitted.
    assert _seated(md, tenants, ready=3)["saas"].admitted


def test_waiting_tenants_are_admitted_premium_first_then_oldest_first_and_strictly_in_order() -> None:
    md = _scaling(max_replicas=6)
    old_std = _tenant(SAAS, "old-std", created="2026-11-01T00:00:00Z", rateLimits={"maxConcurrent": 24})
    new_std = _tenant(SAAS, "new-std", created="2026-11-03T00:00:00Z", rateLimits={"maxConcurrent": 8})
    gold = _tenant(
        SAAS, "gold", created="2026-11-02T00:00:00Z", tier="premium", rateLimits={"maxConcurrent": 30}
    )
    tenants = [old_std, new_std, gold]
    # One ready replica (24 seats): the premium tenant is first in line and does not fit; nobody behind it
    # goes ahead, not even new-std whose 8 would fit.
    one = _seated(md, tenants, ready=1)
    assert [n for n in ("gold", "old-std", "new-std") if one[n].admitted] == []
    assert {one[n].reason for n in one} == {reasons.WAITING_FOR_CAPACITY}
    assert "and 30 to tenants waiting ahead of it" in one["old-std"].message
    # Two ready (48): gold (30) fits, old-std (24) does not, so new-std waits behind it.
    two = _seated(md, tenants, ready=2)
    assert [n for n in ("gold", "old-std", "new-std") if two[n].admitted] == ["gold"]
    # Three (72): gold and old-std; new-std's 8 would make 62: fits too.
    three = _seated(md, tenants, ready=3)
    assert all(three[n].admitted for n in ("gold", "old-std", "new-std"))
    # Once admitted (status.admittedQuota), seats are kept whatever the replicas: none ready, all stay.
    kept = [_admitted_before(t) for t in tenants]
    assert all(d.admitted for d in _seated(md, kept, ready=0).values())


def test_a_tenant_that_would_not_fit_even_at_max_replicas_is_refused_and_holds_back_no_one() -> None:
    md = _scaling(max_replicas=2)  # 48 seats at most
    big = _tenant(
        SAAS, "big", created="2026-11-01T00:00:00Z", tier="premium", rateLimits={"maxConcurrent": 60}
    )
    small = _tenant(SAAS, "small", created="2026-11-02T00:00:00Z", rateLimits={"maxConcurrent": 10})
    decided = _seated(md, [big, small], ready=1)
    assert decided["big"].reason == reasons.CONCURRENCY_EXCEEDS_CAPACITY
    assert (
        "need 3 replicas at 24 per replica; spec.pool.autoscaling.maxReplicas is 2" in decided["big"].message
    )
    assert decided["small"].admitted  # 10 of the ready replica's 24
    floor = compute_guarantee_floor(md, [big, small], list(decided.values()))
    assert (floor.seats, floor.waiting) == (10, 0)  # the refused tenant asks for no replicas
    status = st.compute_tenant_status(big, decided["big"], None, None, False, "", "k", NOW)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ConcurrencyExceedsCapacity"


def test_a_waiting_tenant_keeps_its_kv_room() -> None:
    md = _scaling()
    capacity = compute_pool_capacity(md)
    # Two standard tenants whose HBM quotas cannot both fit: the older waits for seats, the younger (no
    # seats promised) is still refused the room the older one's quota holds.
    older = _tenant(SAAS, "older", created="2026-11-01T00:00:00Z", kvQuota={"hbm": "60%"}, burstLimit="70%")
    younger = _tenant(
        SAAS,
        "younger",
        created="2026-11-02T00:00:00Z",
        kvQuota={"hbm": "60%"},
        burstLimit="70%",
        rateLimits={},
    )
    decided = {
        d.name: d for d in admit_seats(md, [older, younger], admit_tenants(capacity, [older, younger]), 0)
    }
    assert decided["older"].reason == reasons.WAITING_FOR_CAPACITY
    assert decided["younger"].reason == reasons.QUOTA_EXCEEDS_CAPACITY


def test_without_autoscaling_nothing_waits_for_seats() -> None:
    md = _md(in_flight=24)
    tenants = [_tenant(SAAS)]
    assert _seated(md, tenants, ready=0)["saas"].admitted


def test_the_seats_that_count_are_on_ready_replicas_that_stay() -> None:
    sts: dict[str, Any] = {"spec": {"replicas": 3}, "status": {"readyReplicas": 3}}
    assert serving_ready_replicas(sts) == 3
    assert serving_ready_replicas(None) == 0
    sts["metadata"] = {"annotations": {ANNOTATION_DRAIN: '{"serving": 1, "since": "2026-12-01T00:00:00Z"}'}}
    assert serving_ready_replicas(sts) == 1  # two are leaving: they take no new requests
    sts["status"]["readyReplicas"] = 0
    assert serving_ready_replicas(sts) == 0


def test_a_scale_out_under_way_does_not_make_admitted_tenants_read_not_ready() -> None:
    """The kwok benchmark's finding: with tenants waiting for capacity (or load) raising the replicas, the
    admitted ones read ModelDeploymentNotReady until the new replicas started. Now they are served once the
    replicas their own seats need are ready."""
    doc = _scaling().model_dump(by_alias=True, mode="json", exclude_none=True)
    doc["spec"]["pool"]["replicas"] = 3  # the HPA followed the floor the waiting tenant raised
    md = ModelDeployment.model_validate(doc)
    gold = _admitted_before(_tenant(SAAS, "gold", tier="premium", rateLimits={"maxConcurrent": 24}))
    waiting = _tenant(SAAS, "late", created="2026-11-05T00:00:00Z", rateLimits={"maxConcurrent": 48})
    tenants = [gold, waiting]
    decisions = admit_seats(md, tenants, _admit(md, tenants), 1)
    assert [d.admitted for d in decisions] == [True, False]
    capacity = compute_pool_capacity(md)

    def statuses(ready: int) -> dict[str, dict[str, Any]]:
        children = [
            {"kind": "StatefulSet", "metadata": {"name": "qwen72b-engine"}, "spec": {"replicas": 3},
             "status": {"readyReplicas": ready}},
            {"kind": "Deployment", "metadata": {"name": "qwen72b-gateway"}, "spec": {"replicas": 2},
             "status": {"readyReplicas": 2}},
        ]  # fmt: skip
        raw = {t.metadata["name"]: t.model_dump(by_alias=True, mode="json") for t in tenants}
        writes = st.compute_served_statuses(
            md.model_dump(by_alias=True, mode="json"), md, capacity, decisions, None, "http://x/v1",
            children, raw, tenants, {}, NOW,
        )  # fmt: skip
        return {str(w.raw["metadata"]["name"]): w.status for w in writes if w.kind.kind == "Tenant"}

    def ready(status: dict[str, Any]) -> dict[str, Any]:
        return next(c for c in status["conditions"] if c["type"] == "Ready")

    one = statuses(ready=1)  # the pool runs 3 for the waiting tenant; one is ready: gold's 24 seats
    assert ready(one["gold"])["status"] == "True", ready(one["gold"])
    assert ready(one["late"])["reason"] == reasons.WAITING_FOR_CAPACITY
    assert ready(statuses(ready=0)["gold"])["status"] == "False"
