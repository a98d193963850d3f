"""What a watched change of a Tenant or a key Secret reconciles (operator/kvfleet_operator/handlers/
kopf_handlers.py, ``OperatorState``): the ModelDeployment referenced, before and after a move; nothing for
a change of the status alone (the operator's own write); a rebased status keeps the transition times
of the conditions that did not flip (reconcile/conditions.py); which ModelDeployment events reconcile; and
the order in which queued reconciles get a slot (``PrioritySlots``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvfleet_operator.handlers.kopf_handlers import KNOWN, NEW, OperatorState, PrioritySlots
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
        self._seen = {}

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


def test_priority_slots_let_a_known_model_deployment_go_first() -> None:
    """Reconciles wait for one of a few slots (``PrioritySlots``): a ModelDeployment reconciled before
    (``KNOWN``) goes ahead of every first reconcile (``NEW``) queued before it, arrival order among
    equals, and never more than the slots run at once."""
    ran: list[str] = []
    running = 0
    most = 0

    async def go() -> None:
        slots = PrioritySlots(2)
        release = asyncio.Event()

        async def work(name: str, priority: int, *, hold: bool = False) -> None:
            nonlocal running, most
            async with slots.hold(priority):
                running += 1
                most = max(most, running)
                ran.append(name)
                if hold:
                    await release.wait()
                await asyncio.sleep(0)
                running -= 1

        first = [asyncio.create_task(work(f"busy{i}", NEW, hold=True)) for i in range(2)]
        await asyncio.sleep(0)
        queued = [asyncio.create_task(work(f"new{i}", NEW)) for i in range(3)]
        await asyncio.sleep(0)
        queued += [asyncio.create_task(work(f"known{i}", KNOWN)) for i in range(2)]
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*first, *queued)

    asyncio.run(go())
    assert ran == ["busy0", "busy1", "known0", "known1", "new0", "new1", "new2"]
    assert most == 2


def test_priority_slots_pass_on_the_slot_of_a_cancelled_waiter() -> None:
    """A waiter cancelled while it waits, or after it was handed the slot but before it ran, takes no slot
    with it: the next waiter still runs."""
    ran: list[str] = []

    async def go() -> None:
        slots = PrioritySlots(1)

        async def work(name: str) -> None:
            async with slots.hold(NEW):
                ran.append(name)

        busy = slots.hold(NEW)
        await busy.__aenter__()
        gone = asyncio.create_task(work("gone"))
        handed = asyncio.create_task(work("handed"))
        last = asyncio.create_task(work("last"))
        await asyncio.sleep(0)
        gone.cancel()  # cancelled while it waits
        await asyncio.gather(gone, return_exceptions=True)
        await busy.__aexit__(None, None, None)  # hands the slot to "handed" ...
        handed.cancel()  # ... cancelled before it ran
        await asyncio.gather(handed, return_exceptions=True)
        await asyncio.wait_for(last, 1)

    asyncio.run(go())
    assert ran == ["last"]


def _model_deployment(*, version: str, generation: int = 1, status: Obj | None = None, **meta: Any) -> Obj:
    obj: Obj = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "md", "namespace": "ns", "resourceVersion": version, "generation": generation}
        | meta,
        "spec": {"pool": {"replicas": generation}},
    }
    if status is not None:
        obj["status"] = status
    return obj


def test_a_model_deployment_event_reconciles_unless_only_what_no_reconcile_reads_changed() -> None:
    """The first event of a ModelDeployment reconciles; one that changes only its status (the reconcile's
    own write) or kopf's annotations (its finalizer's handler records) does not; a spec edit, another
    annotation, the deletion mark and a deletion do."""
    state = RecordingState()
    seen = state.changed
    assert seen(None, _model_deployment(version="1"))
    assert not seen("MODIFIED", _model_deployment(version="2", status={"observedGeneration": 1}))
    kopf_record = {"kvfleet.io/last-handled-configuration": "{}"}
    assert not seen("MODIFIED", _model_deployment(version="3", annotations=kopf_record))
    assert seen("MODIFIED", _model_deployment(version="4", generation=2))
    assert seen("MODIFIED", _model_deployment(version="5", generation=2, annotations={"team": "a"}))
    assert seen(
        "MODIFIED", _model_deployment(version="6", generation=2, deletionTimestamp="2026-01-01T00:00:00Z")
    )
    assert seen("DELETED", _model_deployment(version="7", generation=2))
    assert seen(None, _model_deployment(version="8", generation=2))  # created again


def _child(kind: str, version: str, status: Obj, replicas: int = 1) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {"name": "c", "namespace": "ns", "resourceVersion": version},
        "spec": {"replicas": replicas},
        "status": status,
    }


def test_a_child_event_reconciles_only_when_what_a_reconcile_reads_changed() -> None:
    """A StatefulSet's ready replicas and a Service's load balancer are read (a pool's readiness, the
    endpoint); a PodDisruptionBudget's counts or a rollout's revision are not; a spec change always is."""
    state = RecordingState()
    seen = state.changed
    assert seen(None, _child("StatefulSet", "1", {"replicas": 1}))
    assert not seen("MODIFIED", _child("StatefulSet", "2", {"replicas": 1, "currentRevision": "r1"}))
    assert seen("MODIFIED", _child("StatefulSet", "3", {"replicas": 1, "readyReplicas": 1}))
    assert seen("MODIFIED", _child("StatefulSet", "4", {"replicas": 1, "readyReplicas": 1}, replicas=2))
    assert seen(None, _child("PodDisruptionBudget", "5", {"currentHealthy": 0}))
    assert not seen("MODIFIED", _child("PodDisruptionBudget", "6", {"currentHealthy": 1}))
    assert seen(None, _child("Service", "7", {}))
    assert seen("MODIFIED", _child("Service", "8", {"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}}))
