from __future__ import annotations

import copy
from typing import Any

import pytest

from kvfleet_operator.reconcile.conditions import failed, merge_conditions, ready
from kvfleet_operator.reconcile.plan import SERVER_OMITS_ZERO, compute_plan, is_subset


def _cm(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "ns"},
        "data": data,
    }


def _deploy(name: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"replicas": replicas},
    }


def test_subset_ignores_server_defaults_but_not_changed_fields() -> None:
    live = {"spec": {"replicas": 2, "strategy": {"type": "RollingUpdate"}}, "metadata": {"uid": "u"}}
    assert is_subset({"spec": {"replicas": 2}}, live)
    assert not is_subset({"spec": {"replicas": 3}}, live)
    assert not is_subset({"spec": {"paused": True}}, live)
    assert not is_subset({"a": [1, 2]}, {"a": [1]})
    # Kubernetes cannot tell an empty list from none: its absence is not drift.
    assert is_subset({"spec": {"items": []}}, live)


@pytest.mark.parametrize(
    "desired",
    [
        pytest.param({"spec": {"automountServiceAccountToken": False}}, id="false"),
        pytest.param({"spec": {"securityContext": {"runAsUser": 0}}}, id="zero"),
        pytest.param({"spec": {"storageClassName": ""}}, id="empty-string"),
        pytest.param({"spec": {"emptyDir": {}}}, id="empty-object"),
    ],
)
def test_a_removed_zero_value_is_drift(desired: dict[str, Any]) -> None:
    """Threat: someone deletes ``allowPrivilegeEscalation: false`` (or another zero-valued field the
    operator sets) from a live object, and the plan, reading absence as false, never restores it."""
    assert not is_subset(desired, {"spec": {}})
    assert is_subset(desired, desired)


def test_only_the_zero_values_the_server_drops_may_be_missing() -> None:
    service = {"spec": {"publishNotReadyAddresses": False, "clusterIP": "None"}}
    live = {"spec": {"clusterIP": "None"}}
    assert is_subset(service, live, SERVER_OMITS_ZERO["Service"])
    assert not is_subset(service, live)  # not listed for this kind: drift
    assert not is_subset(
        {"spec": {"publishNotReadyAddresses": True}}, {"spec": {}}, SERVER_OMITS_ZERO["Service"]
    )
    toleration = {
        "spec": {"template": {"spec": {"tolerations": [{"key": "k", "operator": "Exists", "value": ""}]}}}
    }
    stored = {"spec": {"template": {"spec": {"tolerations": [{"key": "k", "operator": "Exists"}]}}}}
    assert is_subset(toleration, stored, SERVER_OMITS_ZERO["StatefulSet"])
    assert not is_subset(toleration, stored, SERVER_OMITS_ZERO["Service"])


def test_a_removed_security_field_is_planned_again() -> None:
    pod = {
        "automountServiceAccountToken": False,
        "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False}}],
    }
    desired = [{**_deploy("e", 2), "spec": {"replicas": 2, "template": {"spec": pod}}}]
    live = copy.deepcopy(desired)
    assert compute_plan(desired, live) == []
    del live[0]["spec"]["template"]["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"]
    assert [a.describe() for a in compute_plan(desired, live)] == ["apply Deployment ns/e"]


def test_converged_state_plans_nothing() -> None:
    desired = [_cm("t", {"k": "v"}), _deploy("e", 2)]
    live = [dict(_cm("t", {"k": "v"}), extra=1), _deploy("e", 2)]
    assert compute_plan(desired, live) == []


def test_drift_and_orphans_are_repaired_in_dependency_order() -> None:
    desired = [_deploy("e", 2), _cm("t", {"k": "v2"})]
    live = [_cm("t", {"k": "v"}), _cm("old", {})]
    plan = [a.describe() for a in compute_plan(desired, live)]
    assert plan == ["apply ConfigMap ns/t", "apply Deployment ns/e", "delete ConfigMap ns/old"]


def test_condition_transition_time_moves_only_on_status_flip() -> None:
    first = merge_conditions(None, ready("Converged", "ok"), 1, "T1")
    again = merge_conditions(first, ready("Converged", "ok"), 2, "T2")
    assert [c["lastTransitionTime"] for c in again] == ["T1", "T1", "T1"]
    assert all(c["observedGeneration"] == 2 for c in again)
    flipped = merge_conditions(again, failed("QuotaExceedsCapacity", "too big"), 3, "T3")
    by_type = {c["type"]: c for c in flipped}
    assert by_type["Ready"]["lastTransitionTime"] == "T3"
    assert by_type["Ready"]["reason"] == "QuotaExceedsCapacity"
    assert by_type["Progressing"]["lastTransitionTime"] == "T1"  # was False, still False
