"""What a watched change of a Tenant or a key Secret reconciles (operator/kvfleet_operator/handlers/
kopf_handlers.py, ``OperatorState``): the ModelDeployment referenced, before and after a move; nothing for
a change of the status alone (the operator's own write); and a rebased status keeps the transition times
of the conditions that did not flip (reconcile/conditions.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_operator.handlers.kopf_handlers import OperatorState
from kvfleet_operator.reconcile.conditions import rebase_conditions

Obj = dict[str, Any]


def _tenant(ref: str, *, status: str | None = None, version: str = "1", generation: int = 1) -> Obj:
    obj: Obj = {
        "metadata": {"name": "t", "namespace": "ns", "resourceVersion": version, "generation": generation},
        "spec": {"modelDeploymentRef": {"name": ref}},
    }
    if status is not None:
        obj["status"] = {"conditions": [{"type": "Ready", "status": status}]}
    return obj


class RecordingState(OperatorState):
    def __init__(self) -> None:
        self.spawned: list[tuple[str, str]] = []

    def _spawn(self, namespace: str, name: str) -> None:
        self.spawned.append((namespace, name))


@pytest.mark.parametrize(
    ("old", "new", "reconciled"),
    [
        pytest.param(None, _tenant("a"), [("ns", "a")], id="created"),
        pytest.param(_tenant("a"), None, [("ns", "a")], id="deleted"),
        pytest.param(
            _tenant("a"), _tenant("b", version="2", generation=2), [("ns", "a"), ("ns", "b")], id="moved"
        ),
        pytest.param(_tenant("a"), _tenant("a", status="True", version="2"), [], id="status-only"),
        pytest.param(
            _tenant("a", status="True"),
            _tenant("a", status="True", version="3", generation=2),
            [("ns", "a")],
            id="spec-edit",
        ),
    ],
)
def test_tenant_changes(old: Obj | None, new: Obj | None, reconciled: list[tuple[str, str]]) -> None:
    state = RecordingState()
    state.tenant_changed(old, new)
    assert sorted(state.spawned) == reconciled


def test_rebase_keeps_the_transition_time_of_what_did_not_flip() -> None:
    new = [
        {"type": "Ready", "status": "True", "lastTransitionTime": "t2"},
        {"type": "Degraded", "status": "True", "lastTransitionTime": "t2"},
    ]
    base = [
        {"type": "Ready", "status": "True", "lastTransitionTime": "t1"},
        {"type": "Degraded", "status": "False", "lastTransitionTime": "t1"},
    ]
    assert rebase_conditions(new, base) == [
        {"type": "Ready", "status": "True", "lastTransitionTime": "t1"},
        {"type": "Degraded", "status": "True", "lastTransitionTime": "t2"},
    ]
    assert rebase_conditions(new, None) == new
