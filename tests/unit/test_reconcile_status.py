"""Status of ModelDeployments and Tenants (reconcile/status.py): tables of what the reconcile saw."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.api import ModelDeployment, ModelDeploymentStatus, Tenant, TenantStatus, reasons
from kvfleet_operator.api.tenant import QuotaTerms
from kvfleet_operator.build.keys import KeyResolution
from kvfleet_operator.build.tenant_table import PoolCapacity, TenantDecision
from kvfleet_operator.k8s import kinds
from kvfleet_operator.reconcile import status as st
from kvfleet_operator.reconcile.conditions import ConditionUpdate
from kvfleet_operator.reconcile.status import WorkloadReadiness
from kvfleet_runtime.config import KVQuota

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOW, EARLIER = "2026-03-01T00:00:00Z", "2026-01-01T00:00:00Z"
ENDPOINT = "http://tiny-gateway.kvfleet-demo.svc:8080/v1"
CAPACITY = PoolCapacity(
    block_size=32,
    hbm_blocks=1000,
    hbm_tokens=32_000,
    hbm_bytes=16_384_000,
    cpu_bytes=1_000_000,
    nvme_bytes=0,
    offload_bytes_per_token=500,
)
QUOTA = KVQuota(hbm_blocks=250, hbm_burst_blocks=500, cpu_bytes=100_000, nvme_bytes=0)
ADMITTED = TenantDecision("t", True, reasons.ADMITTED, "250 guaranteed HBM blocks.", "shared", QUOTA)
REJECTED = TenantDecision(
    "t", False, reasons.QUOTA_EXCEEDS_CAPACITY, "HBM guarantees would total 1250.", "shared"
)
UP = WorkloadReadiness(wanted=1, ready=1)
DOWN = WorkloadReadiness(wanted=1, ready=0)


def _raw_md(generation: int = 3, conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "local/modeldeployment-tiny.yaml").read_text())
    doc["metadata"].update(uid="md-uid", generation=generation)
    if conditions is not None:
        doc["status"] = {"conditions": conditions}
    return doc


def _md(**kw: Any) -> ModelDeployment:
    return ModelDeployment.model_validate(_raw_md(**kw))


def _raw_tenant(
    name: str = "t",
    generation: int = 2,
    dedicated: bool = False,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"modelDeploymentRef": {"name": "tiny"}}
    if dedicated:
        spec |= {"isolation": "dedicated", "dedicated": {"gpuGroup": "g", "replicas": 2}}
    doc: dict[str, Any] = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "Tenant",
        "metadata": {
            "name": name,
            "namespace": "kvfleet-demo",
            "uid": f"uid-{name}",
            "generation": generation,
        },
        "spec": spec,
    }
    if conditions is not None:
        doc["status"] = {"conditions": conditions}
    return doc


def _tenant(**kw: Any) -> Tenant:
    return Tenant.model_validate(_raw_tenant(**kw))


def _ready(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def _by_type(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


# --- ModelDeployment -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engines", "gateway", "problem", "conditions", "message_part"),
    [
        pytest.param(
            UP,
            UP,
            None,
            {"Ready": ("True", "Ready"), "Progressing": ("False", "Ready"), "Degraded": ("False", "Ready")},
            f"serve {ENDPOINT}",
            id="all-ready",
        ),
        pytest.param(
            DOWN,
            UP,
            None,
            {
                "Ready": ("False", "WaitingForReplicas"),
                "Progressing": ("True", "WaitingForReplicas"),
                "Degraded": ("False", "WaitingForReplicas"),
            },
            "0/1 engine replicas and 1/1 gateway replicas are ready",
            id="engines-starting",
        ),
        pytest.param(
            UP,
            WorkloadReadiness(wanted=2, ready=1),
            None,
            {
                "Ready": ("False", "WaitingForReplicas"),
                "Progressing": ("True", "WaitingForReplicas"),
                "Degraded": ("False", "WaitingForReplicas"),
            },
            "1/2 gateway replicas",
            id="gateway-starting",
        ),
        pytest.param(
            UP,
            UP,
            st.problem(reasons.CAPACITY_UNKNOWN, "no gpuMemory"),
            {
                "Ready": ("False", "CapacityUnknown"),
                "Progressing": ("False", "CapacityUnknown"),
                "Degraded": ("True", "CapacityUnknown"),
            },
            "no gpuMemory",
            id="problem-wins-over-readiness",
        ),
    ],
)
def test_model_deployment_conditions(
    engines: WorkloadReadiness,
    gateway: WorkloadReadiness,
    problem: ConditionUpdate | None,
    conditions: dict[str, tuple[str, str]],
    message_part: str,
) -> None:
    status = st.compute_model_deployment_status(_md(), CAPACITY, [], engines, gateway, ENDPOINT, problem, NOW)
    assert _by_type(status) == conditions
    assert message_part in _ready(status)["message"]
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    assert status["observedGeneration"] == 3


def test_model_deployment_status_fields() -> None:
    status = st.compute_model_deployment_status(_md(), CAPACITY, [], UP, UP, ENDPOINT, None, NOW)
    assert (status["replicas"], status["readyReplicas"], status["endpoint"]) == (1, 1, ENDPOINT)
    # The scale subresource's selector finds the shared pool's engine pods.
    assert set(status["selector"].split(",")) == {
        "app.kubernetes.io/name=kvfleet",
        "app.kubernetes.io/instance=tiny",
        "app.kubernetes.io/component=engine",
        "kvfleet.io/pool=shared",
    }


@pytest.mark.parametrize(
    ("decisions", "guaranteed"),
    [
        pytest.param(
            [],
            {
                "tenants": 0,
                "hbmTokens": 0,
                "hbmShare": "0%",
                "cpuBytes": 0,
                "nvmeBytes": 0,
                "seats": 0,
                "replicas": 0,
                "waitingSeats": 0,
            },
            id="none",
        ),
        pytest.param(
            [ADMITTED],
            {
                "tenants": 1,
                "hbmTokens": 250 * 32,
                "hbmShare": "25%",
                "cpuBytes": 100_000,
                "nvmeBytes": 0,
                "seats": 0,
                "replicas": 0,
                "waitingSeats": 0,
            },
            id="one-admitted",
        ),
        pytest.param(
            [ADMITTED, REJECTED],
            {
                "tenants": 2,
                "hbmTokens": 250 * 32,
                "hbmShare": "25%",
                "cpuBytes": 100_000,
                "nvmeBytes": 0,
                "seats": 0,
                "replicas": 0,
                "waitingSeats": 0,
            },
            id="rejected-guarantees-nothing",
        ),
        pytest.param(
            [TenantDecision("d", True, reasons.ADMITTED, "", "dedicated-d", QUOTA)],
            {
                "tenants": 1,
                "hbmTokens": 0,
                "hbmShare": "0%",
                "cpuBytes": 0,
                "nvmeBytes": 0,
                "seats": 0,
                "replicas": 0,
                "waitingSeats": 0,
            },
            id="dedicated-pool-guarantees-nothing-on-the-shared-pool",
        ),
    ],
)
def test_guaranteed(decisions: list[TenantDecision], guaranteed: dict[str, Any]) -> None:
    status = st.compute_model_deployment_status(_md(), CAPACITY, decisions, UP, UP, ENDPOINT, None, NOW)
    assert status["guaranteed"] == guaranteed


def test_kv_capacity_per_replica_and_pool() -> None:
    md = _md()
    md.spec.pool.replicas = 3
    status = st.compute_model_deployment_status(md, CAPACITY, [], UP, UP, ENDPOINT, None, NOW)
    per_replica, pool = status["kvCapacity"]["perReplica"], status["kvCapacity"]["pool"]
    assert per_replica["hbm"] == {"tokens": 32_000, "bytes": 16_384_000, "blocks": 1000}
    assert per_replica["cpu"] == {"tokens": 2000, "bytes": 1_000_000, "blocks": 0}
    assert pool["hbm"] == {"tokens": 96_000, "bytes": 3 * 16_384_000, "blocks": 3000}
    assert pool["cpu"]["tokens"] == 6000
    assert status["kvCapacity"]["summary"] == "96K tok"


def test_no_capacity_no_capacity_figures() -> None:
    problem = st.problem(reasons.CAPACITY_UNKNOWN, "x")
    status = st.compute_model_deployment_status(_md(), None, [], UP, UP, ENDPOINT, problem, NOW)
    assert status["kvCapacity"]["pool"]["hbm"]["tokens"] == 0
    assert status["guaranteed"]["tenants"] == 0


def test_transition_time_moves_only_when_a_status_flips() -> None:
    first = st.compute_model_deployment_status(_md(), CAPACITY, [], UP, UP, ENDPOINT, None, EARLIER)
    again = st.compute_model_deployment_status(
        _md(conditions=first["conditions"]), CAPACITY, [], UP, UP, ENDPOINT, None, NOW
    )
    assert {c["lastTransitionTime"] for c in again["conditions"]} == {EARLIER}
    assert not st.status_changed(first, again, ModelDeploymentStatus)  # a converged object is not written
    down = st.compute_model_deployment_status(
        _md(conditions=first["conditions"]), CAPACITY, [], DOWN, UP, ENDPOINT, None, NOW
    )
    times = {c["type"]: c["lastTransitionTime"] for c in down["conditions"]}
    assert times == {"Ready": NOW, "Progressing": NOW, "Degraded": EARLIER}


# --- Tenant ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("decision", "problem", "pool_ready", "ready", "endpoint"),
    [
        pytest.param(ADMITTED, None, True, ("True", "Ready"), ENDPOINT, id="admitted-and-serving"),
        pytest.param(
            ADMITTED, None, False, ("False", "ModelDeploymentNotReady"), ENDPOINT, id="admitted-pool-starting"
        ),
        pytest.param(REJECTED, None, True, ("False", "QuotaExceedsCapacity"), "", id="rejected"),
        pytest.param(None, None, True, ("False", "InvalidSpec"), "", id="no-decision"),
        pytest.param(
            ADMITTED,
            st.problem(reasons.API_KEY_SECRET_NOT_FOUND, "create it"),
            True,
            ("False", "ApiKeySecretNotFound"),
            "",
            id="problem-wins-over-admission",
        ),
        pytest.param(
            None,
            st.model_deployment_problem_for_tenant(st.problem(reasons.CAPACITY_UNKNOWN, "no gpuMemory")),
            False,
            ("False", "ModelDeploymentNotReady"),  # Progressing=True: waiting, not broken
            "",
            id="waits-on-its-model-deployment",
        ),
    ],
)
def test_tenant_ready_condition(
    decision: TenantDecision | None,
    problem: ConditionUpdate | None,
    pool_ready: bool,
    ready: tuple[str, str],
    endpoint: str,
) -> None:
    status = st.compute_tenant_status(
        _tenant(), decision, CAPACITY, problem, pool_ready, ENDPOINT, "t-api-key", NOW
    )
    assert (_ready(status)["status"], _ready(status)["reason"]) == ready
    assert _ready(status)["observedGeneration"] == 2
    assert status["endpoint"] == endpoint  # only an admitted tenant without a problem
    assert status["apiKeySecretName"] == "t-api-key"


@pytest.mark.parametrize(
    ("problem", "degraded", "progressing"),
    [
        pytest.param(st.problem(reasons.INVALID_SPEC, "x"), "True", "False", id="false-problem-degrades"),
        pytest.param(
            st.model_deployment_problem_for_tenant(st.problem(reasons.CAPACITY_UNKNOWN, "x")),
            "False",
            "True",
            id="unknown-problem-is-progress-not-degradation",
        ),
    ],
)
def test_tenant_problem_kinds(problem: ConditionUpdate, degraded: str, progressing: str) -> None:
    status = st.compute_tenant_status(_tenant(), None, None, problem, False, ENDPOINT, "s", NOW)
    by_type = _by_type(status)
    assert (by_type["Degraded"][0], by_type["Progressing"][0]) == (degraded, progressing)


@pytest.mark.parametrize(
    ("decision", "capacity", "resolved"),
    [
        pytest.param(
            ADMITTED,
            CAPACITY,
            {
                "hbmBlocks": 250,
                "hbmTokens": 8000,
                "hbmBytes": 250 * 16_384,
                "hbmBurstBlocks": 500,
                "cpuBytes": 100_000,
                "nvmeBytes": 0,
            },
            id="admitted-quota-in-every-unit",
        ),
        pytest.param(REJECTED, CAPACITY, {}, id="rejected-has-no-quota"),
        pytest.param(ADMITTED, None, {}, id="no-capacity-no-units"),
    ],
)
def test_resolved_quota(
    decision: TenantDecision, capacity: PoolCapacity | None, resolved: dict[str, int]
) -> None:
    status = st.compute_tenant_status(_tenant(), decision, capacity, None, True, ENDPOINT, "s", NOW)
    zeros = dict.fromkeys(
        ("hbmBlocks", "hbmTokens", "hbmBytes", "hbmBurstBlocks", "cpuBytes", "nvmeBytes"), 0
    )
    assert status["resolvedQuota"] == (resolved or zeros)


# --- Failures, orphans, whole cycles -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("cause", "reason"),
    [
        pytest.param(
            st.problem(reasons.API_KEY_SECRET_NOT_FOUND, "m"), "ApiKeySecretNotFound", id="with-cause"
        ),
        pytest.param(None, "InvalidSpec", id="without-cause"),
    ],
)
def test_failure_status_touches_conditions_only(cause: ConditionUpdate | None, reason: str) -> None:
    raw = _raw_tenant(generation=5)
    raw["status"] = {"endpoint": "kept", "conditions": []}
    before = copy.deepcopy(raw)
    status = st.compute_failure_status(raw, cause, NOW)
    assert set(status) == {"conditions", "observedGeneration"}
    assert status["observedGeneration"] == 5
    assert _by_type(status) == {
        "Ready": ("False", reason),
        "Progressing": ("False", reason),
        "Degraded": ("True", reason),
    }
    assert raw == before  # computed on a copy


@pytest.mark.parametrize(
    ("raw_md", "writes"),
    [
        pytest.param(
            None,
            [("Tenant", "a", "ModelDeploymentNotFound"), ("Tenant", "b", "ModelDeploymentNotFound")],
            id="missing",
        ),
        pytest.param(
            {**_raw_md(), "metadata": {**_raw_md()["metadata"], "deletionTimestamp": EARLIER}},
            [("Tenant", "a", "ModelDeploymentDeleting"), ("Tenant", "b", "ModelDeploymentDeleting")],
            id="deleting",
        ),
        pytest.param(
            _raw_md(), [("ModelDeployment", "tiny", "InvalidSpec")], id="invalid-spec-tenants-left-alone"
        ),
    ],
)
def test_unserved_statuses(raw_md: dict[str, Any] | None, writes: list[tuple[str, str, str]]) -> None:
    problem = st.problem(reasons.INVALID_SPEC, "spec.pool: bad")
    result = st.compute_unserved_statuses("tiny", raw_md, [_raw_tenant("a"), _raw_tenant("b")], problem, NOW)
    assert [(w.kind.kind, w.raw["metadata"]["name"], _ready(w.status)["reason"]) for w in result] == writes


def _sts(name: str, ready: int) -> dict[str, Any]:
    return {"kind": "StatefulSet", "metadata": {"name": name}, "status": {"readyReplicas": ready}}


def _deploy(name: str, ready: int) -> dict[str, Any]:
    return {"kind": "Deployment", "metadata": {"name": name}, "status": {"readyReplicas": ready}}


DEDICATED = TenantDecision("t", True, reasons.ADMITTED, "", "dedicated-t", QUOTA)


@pytest.mark.parametrize(
    ("dedicated", "decision", "children", "ready"),
    [
        pytest.param(
            False, ADMITTED, [_sts("tiny-engine", 1), _deploy("tiny-gateway", 1)], True, id="shared-up"
        ),
        pytest.param(
            False, ADMITTED, [_sts("tiny-engine", 0), _deploy("tiny-gateway", 1)], False, id="shared-down"
        ),
        pytest.param(False, ADMITTED, [_sts("tiny-engine", 1)], False, id="no-gateway-yet"),
        pytest.param(
            True,
            DEDICATED,
            [_sts("tiny-engine", 0), _sts("tiny-dedicated-t-engine", 2), _deploy("tiny-gateway", 1)],
            True,
            id="dedicated-up-while-shared-is-down",
        ),
        pytest.param(
            True,
            DEDICATED,
            [_sts("tiny-engine", 1), _sts("tiny-dedicated-t-engine", 1), _deploy("tiny-gateway", 1)],
            False,
            id="dedicated-wants-its-own-replica-count",
        ),
    ],
)
def test_tenant_pool_ready(
    dedicated: bool, decision: TenantDecision, children: list[dict[str, Any]], ready: bool
) -> None:
    assert st.compute_tenant_pool_ready(_md(), _tenant(dedicated=dedicated), decision, children) is ready


def test_served_statuses_model_deployment_first_then_tenants_in_listed_order() -> None:
    raw_tenants = {"b": _raw_tenant("b"), "bad": _raw_tenant("bad"), "a": _raw_tenant("a")}
    tenants = [_tenant(name="a"), _tenant(name="b")]
    decisions = [
        TenantDecision("a", True, reasons.ADMITTED, "", "shared", QUOTA),
        TenantDecision("b", False, reasons.QUOTA_EXCEEDS_CAPACITY, "too big", "shared"),
    ]
    problems = {"bad": st.problem(reasons.API_KEY_SECRET_NOT_FOUND, "create it")}
    children = [_sts("tiny-engine", 1), _deploy("tiny-gateway", 1)]
    raw_md = _raw_md()
    writes = st.compute_served_statuses(
        raw_md, _md(), CAPACITY, decisions, None, ENDPOINT, children, raw_tenants, tenants, problems, NOW
    )
    assert [(w.kind, w.raw["metadata"]["name"], _ready(w.status)["reason"]) for w in writes] == [
        (kinds.MODEL_DEPLOYMENT, "tiny", "Ready"),
        (kinds.TENANT, "b", "QuotaExceedsCapacity"),
        (kinds.TENANT, "bad", "ApiKeySecretNotFound"),
        (kinds.TENANT, "a", "Ready"),
    ]
    assert writes[0].raw is raw_md and "status" not in raw_md  # the object as read is never edited
    assert set(writes[2].status) == {"conditions", "observedGeneration"}  # a failure: conditions only
    assert writes[3].status["apiKeySecretName"] == "a-api-key"
    assert all(w.changed for w in writes)  # nothing had a status yet


def test_served_statuses_while_the_model_deployment_has_a_problem() -> None:
    problem = st.problem(reasons.CAPACITY_UNKNOWN, "no gpuMemory")
    writes = st.compute_served_statuses(
        _raw_md(),
        _md(),
        None,
        [],
        problem,
        ENDPOINT,
        [],
        {"a": _raw_tenant("a")},
        [_tenant(name="a")],
        {},
        NOW,
    )
    assert [_by_type(w.status) for w in writes] == [
        {
            "Ready": ("False", "CapacityUnknown"),
            "Progressing": ("False", "CapacityUnknown"),
            "Degraded": ("True", "CapacityUnknown"),
        },
        {
            "Ready": ("False", "ModelDeploymentNotReady"),
            "Progressing": ("True", "ModelDeploymentNotReady"),
            "Degraded": ("False", "ModelDeploymentNotReady"),
        },
    ]
    assert _ready(writes[1].status)["message"] == "no gpuMemory"


def test_a_converged_status_is_not_changed() -> None:
    first = st.compute_served_statuses(
        _raw_md(),
        _md(),
        CAPACITY,
        [],
        None,
        ENDPOINT,
        [_sts("tiny-engine", 1), _deploy("tiny-gateway", 1)],
        {},
        [],
        {},
        EARLIER,
    )[0]
    raw = {**_raw_md(), "status": first.status}
    again = st.compute_served_statuses(
        raw,
        ModelDeployment.model_validate(raw),
        CAPACITY,
        [],
        None,
        ENDPOINT,
        [_sts("tiny-engine", 1), _deploy("tiny-gateway", 1)],
        {},
        [],
        {},
        NOW,
    )[0]
    assert not again.changed


# --- Events and change detection -----------------------------------------------------------------------


def _cond(status: str, reason: str) -> list[dict[str, Any]]:
    return [{"type": "Ready", "status": status, "reason": reason, "message": "m", "lastTransitionTime": NOW}]


@pytest.mark.parametrize(
    ("before", "after", "event"),
    [
        pytest.param(None, _cond("True", "Ready"), ("Normal", "Ready"), id="first-ready"),
        pytest.param(
            _cond("False", "WaitingForReplicas"), _cond("True", "Ready"), ("Normal", "Ready"), id="flips-up"
        ),
        pytest.param(
            _cond("True", "Ready"),
            _cond("False", "QuotaExceedsCapacity"),
            ("Warning", "QuotaExceedsCapacity"),
            id="flips-down",
        ),
        pytest.param(
            _cond("False", "WaitingForReplicas"),
            _cond("False", "CapacityUnknown"),
            ("Warning", "CapacityUnknown"),
            id="new-reason-same-status",
        ),
        pytest.param(_cond("True", "Ready"), _cond("True", "Ready"), None, id="nothing-new"),
        pytest.param(_cond("True", "Ready"), [], None, id="no-ready-condition"),
    ],
)
def test_ready_event(
    before: list[dict[str, Any]] | None, after: list[dict[str, Any]], event: tuple[str, str] | None
) -> None:
    obj = _raw_tenant()
    result = st.compute_ready_event(obj, before, after)
    if event is None:
        assert result is None
        return
    assert result is not None
    assert (result["type"], result["reason"]) == event
    assert result["involvedObject"] == {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "Tenant",
        "name": "t",
        "namespace": "kvfleet-demo",
        "uid": "uid-t",
    }
    assert result["metadata"] == {"generateName": "t.", "namespace": "kvfleet-demo"}


FINGERPRINTS = {"current": "sha256:aaaaaaaaaaaa", "previous": "sha256:bbbbbbbbbbbb"}


@pytest.mark.parametrize(
    ("current", "desired", "changed"),
    [
        pytest.param(None, {"observedGeneration": 1}, True, id="no-status-yet"),
        pytest.param({"observedGeneration": 1}, {"observedGeneration": 1}, False, id="same"),
        pytest.param({"observedGeneration": 1}, {"observedGeneration": 2}, True, id="new-generation"),
        pytest.param({"endpoint": "", "apiKeySecretName": ""}, {}, False, id="defaults-the-server-fills-in"),
        pytest.param(
            {"apiKeyFingerprints": FINGERPRINTS},
            {"apiKeyFingerprints": {"current": FINGERPRINTS["current"]}},
            True,
            id="a-field-that-goes-is-a-change",
        ),
        pytest.param(
            {"admittedQuota": {"hbm": "10%", "cpu": "0", "nvme": "0", "burstLimit": "50%"}},
            {},
            True,
            id="admitted-quota-removed",
        ),
        pytest.param({"bogus": 1}, {}, True, id="unreadable-status-is-rewritten"),
    ],
)
def test_status_changed(current: dict[str, Any] | None, desired: dict[str, Any], changed: bool) -> None:
    assert st.status_changed(current, desired, TenantStatus) is changed


ADMITTED_TERMS = {"hbm": "25%", "cpu": "100000", "nvme": "0", "burstLimit": "50%"}
REFUSED_RAISE = TenantDecision(
    "t",
    True,
    reasons.QUOTA_CHANGE_REFUSED,
    "250 guaranteed HBM blocks.",
    "shared",
    QUOTA,
    requested=QuotaTerms.model_validate({**ADMITTED_TERMS, "hbm": "90%", "burstLimit": "90%"}),
    terms=QuotaTerms.model_validate(ADMITTED_TERMS),
    refused="HBM guarantees would total 1150 of 1000 blocks",
)


@pytest.mark.parametrize(
    ("pool_ready", "conditions"),
    [
        pytest.param(
            True,
            {
                "Ready": ("True", "QuotaChangeRefused"),
                "Progressing": ("False", "QuotaChangeRefused"),
                "Degraded": ("True", "QuotaChangeRefused"),
            },
            id="serving",
        ),
        pytest.param(
            False,
            {
                "Ready": ("False", "ModelDeploymentNotReady"),
                "Progressing": ("True", "ModelDeploymentNotReady"),
                "Degraded": ("True", "QuotaChangeRefused"),
            },
            id="pool-starting",
        ),
    ],
)
def test_a_refused_quota_change_degrades_a_serving_tenant(
    pool_ready: bool, conditions: dict[str, tuple[str, str]]
) -> None:
    status = st.compute_tenant_status(
        _tenant(), REFUSED_RAISE, CAPACITY, None, pool_ready, ENDPOINT, "s", NOW
    )
    assert _by_type(status) == conditions
    assert status["admittedQuota"] == ADMITTED_TERMS
    assert status["endpoint"] == ENDPOINT  # still serving
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "1150 of 1000 blocks" in degraded["message"]
    event = st.compute_ready_event(_raw_tenant(), _cond("True", "Ready"), status["conditions"])
    if pool_ready:
        assert event is not None and (event["type"], event["reason"]) == ("Warning", "QuotaChangeRefused")


def test_admitted_quota_stays_while_the_model_deployment_cannot_be_served() -> None:
    raw = _raw_tenant()
    raw["status"] = {"admittedQuota": ADMITTED_TERMS}
    cause = st.model_deployment_problem_for_tenant(st.problem(reasons.CAPACITY_UNKNOWN, "no gpuMemory"))
    status = st.compute_tenant_status(
        Tenant.model_validate(raw), None, None, cause, False, ENDPOINT, "s", NOW
    )
    assert status["admittedQuota"] == ADMITTED_TERMS


@pytest.mark.parametrize(("keep", "kept"), [(True, True), (False, False)])
def test_failure_status_keeps_the_admitted_quota_only_when_asked(keep: bool, kept: bool) -> None:
    raw = _raw_tenant()
    raw["status"] = {"admittedQuota": ADMITTED_TERMS, "endpoint": "x"}
    cause = st.problem(reasons.API_KEY_SHARED, "m")
    status = st.compute_failure_status(raw, cause, NOW, keep_admitted_quota=keep)
    assert ("admittedQuota" in status) is kept
    assert "endpoint" not in status


def test_fingerprints_only_for_a_served_tenant() -> None:
    keys = KeyResolution("s", hashes=("a" * 64, "b" * 64), fingerprints=("sha256:aaa", "sha256:bbb"))
    served = st.compute_tenant_status(_tenant(), ADMITTED, CAPACITY, None, True, ENDPOINT, "s", NOW, keys)
    assert served["apiKeyFingerprints"] == {"current": "sha256:aaa", "previous": "sha256:bbb"}
    rejected = st.compute_tenant_status(_tenant(), REJECTED, CAPACITY, None, True, ENDPOINT, "s", NOW, keys)
    assert "apiKeyFingerprints" not in rejected


def _conds(*triples: tuple[str, str, str]) -> list[dict[str, Any]]:
    return [
        {"type": t, "status": s, "reason": r, "message": "m", "lastTransitionTime": NOW}
        for t, s, r in triples
    ]


@pytest.mark.parametrize(
    ("before", "after", "events"),
    [
        pytest.param(
            _conds(
                ("Ready", "False", "ModelDeploymentNotReady"),
                ("Degraded", "False", "ModelDeploymentNotReady"),
            ),
            _conds(("Ready", "False", "ModelDeploymentNotReady"), ("Degraded", "True", "QuotaChangeRefused")),
            [("Warning", "QuotaChangeRefused")],
            id="degraded-while-ready-says-nothing-new",
        ),
        pytest.param(
            _conds(("Ready", "True", "Ready"), ("Degraded", "False", "Ready")),
            _conds(("Ready", "False", "QuotaExceedsCapacity"), ("Degraded", "True", "QuotaExceedsCapacity")),
            [("Warning", "QuotaExceedsCapacity")],
            id="one-event-per-reason",
        ),
        pytest.param(
            _conds(("Ready", "True", "QuotaChangeRefused"), ("Degraded", "True", "QuotaChangeRefused")),
            _conds(("Ready", "True", "QuotaChangeRefused"), ("Degraded", "True", "QuotaChangeRefused")),
            [],
            id="nothing-new",
        ),
    ],
)
def test_events(
    before: list[dict[str, Any]], after: list[dict[str, Any]], events: list[tuple[str, str]]
) -> None:
    assert [(e["type"], e["reason"]) for e in st.compute_events(_raw_tenant(), before, after)] == events


@pytest.mark.parametrize(
    ("before", "after", "on_md"),
    [
        pytest.param(None, _cond("True", "Ready"), True, id="first-ready"),
        pytest.param(
            _cond("False", "ModelDeploymentNotReady"), _cond("True", "Ready"), True, id="pool-ready"
        ),
        pytest.param(None, _cond("False", "ModelDeploymentNotReady"), True, id="waits-for-its-pool"),
        pytest.param(_cond("True", "Ready"), _cond("False", "ModelDeploymentNotReady"), True, id="pool-down"),
        pytest.param(None, _cond("False", "QuotaExceedsCapacity"), False, id="own-problem"),
        pytest.param(_cond("True", "Ready"), _cond("False", "ApiKeyShared"), False, id="own-key"),
    ],
)
def test_a_tenants_pool_news_is_told_on_its_model_deployment(
    before: list[dict[str, Any]] | None, after: list[dict[str, Any]], on_md: bool
) -> None:
    (event,) = st.compute_events(_raw_tenant(), before, after)
    assert st.told_on_model_deployment(event) is on_md


def test_one_summary_event_per_kind_names_the_tenants() -> None:
    ready = [st.compute_events(_raw_tenant(f"t{i:02d}"), None, _cond("True", "Ready"))[0] for i in range(25)]
    waiting = st.compute_events(_raw_tenant("w"), None, _cond("False", "ModelDeploymentNotReady"))
    events = st.compute_tenant_summary_events(_raw_md(), [*ready, *waiting], NOW)
    assert [(e["type"], e["reason"]) for e in events] == [
        ("Normal", "TenantsReady"),
        ("Normal", "TenantsWaiting"),
    ]
    assert events[0]["involvedObject"]["kind"] == "ModelDeployment"
    assert events[0]["involvedObject"]["uid"] == "md-uid"
    assert events[0]["message"].startswith("25 tenant(s) became Ready: t00, t01,")
    assert events[0]["message"].endswith("t19 and 5 more.")
    assert events[1]["message"] == "1 tenant(s) wait for this ModelDeployment's pools: w."
    assert st.compute_tenant_summary_events(_raw_md(), [], NOW) == []


# --- the shared KV tier (spec.kvCache.shared) ------------------------------------------------------------


def _md_with_tier() -> ModelDeployment:
    doc = _raw_md()
    doc["spec"]["kvCache"]["shared"] = {"enabled": True, "size": "1Gi"}
    return ModelDeployment.model_validate(doc)


@pytest.mark.parametrize(("tier_ready", "ready"), [(1, True), (0, False)], ids=["tier-up", "tier-down"])
def test_a_shared_tier_that_is_down_keeps_the_model_deployment_and_its_shared_tenants_not_ready(
    tier_ready: int, ready: bool
) -> None:
    """The shared pool's replicas read and write the tier: with its server down, neither the
    ModelDeployment nor a tenant of the shared pool is Ready, and the message says what is missing."""
    md = _md_with_tier()
    children = [_sts("tiny-engine", 1), _deploy("tiny-gateway", 1), _deploy("tiny-shared-tier", tier_ready)]
    tier = st.shared_tier_readiness(md, children)
    assert tier == WorkloadReadiness(wanted=1, ready=tier_ready)
    status = st.compute_model_deployment_status(
        md, CAPACITY, [], UP, UP, ENDPOINT, None, NOW, shared_tier=tier
    )
    assert (_ready(status)["status"] == "True") is ready
    assert ("the shared KV tier is not" in _ready(status)["message"]) is not ready
    assert st.compute_tenant_pool_ready(md, _tenant(), ADMITTED, children) is ready
    # A dedicated pool never uses the tier: its tenant does not wait for it.
    dedicated = [*children, _sts("tiny-dedicated-t-engine", 2)]
    assert st.compute_tenant_pool_ready(md, _tenant(dedicated=True), DEDICATED, dedicated) is True


def test_without_a_shared_tier_nothing_waits_for_one() -> None:
    assert st.shared_tier_readiness(_md(), [_sts("tiny-engine", 1), _deploy("tiny-gateway", 1)]) is None


def test_served_statuses_wait_for_the_shared_tier() -> None:
    md = _md_with_tier()
    raw_md = md.model_dump(by_alias=True, mode="json", exclude_none=True)
    decisions = [TenantDecision("t", True, reasons.ADMITTED, "", "shared", QUOTA)]
    children = [_sts("tiny-engine", 1), _deploy("tiny-gateway", 1), _deploy("tiny-shared-tier", 0)]
    writes = st.compute_served_statuses(
        raw_md, md, CAPACITY, decisions, None, ENDPOINT, children, {"t": _raw_tenant()}, [_tenant()], {}, NOW
    )
    assert [_ready(w.status)["status"] for w in writes] == ["False", "False"]
