"""The operator's batched Tenant status writes (operator/kvfleet_operator/handlers/status_writer.py),
against a recording client: the newest status wins, a status that only waits for the pool is held and
replaced by Ready when the pool gets there first, an unchanged status cancels what waits, and the pool's
news of many tenants is one Event on the ModelDeployment."""

from __future__ import annotations

import asyncio
from typing import Any

from kvfleet_operator.handlers.status_writer import StatusWriter
from kvfleet_operator.k8s import kinds
from kvfleet_operator.reconcile import status as st

Obj = dict[str, Any]
NOW = "2026-01-01T00:00:00Z"


def _conditions(ready: str, reason: str, progressing: str) -> list[Obj]:
    return [
        {"type": "Ready", "status": ready, "reason": reason, "message": "m", "lastTransitionTime": NOW},
        {
            "type": "Progressing",
            "status": progressing,
            "reason": reason,
            "message": "m",
            "lastTransitionTime": NOW,
        },
        {"type": "Degraded", "status": "False", "reason": reason, "message": "m", "lastTransitionTime": NOW},
    ]


WAITING = {"conditions": _conditions("False", "ModelDeploymentNotReady", "True"), "observedGeneration": 1}
READY = {"conditions": _conditions("True", "Ready", "False"), "observedGeneration": 1}
REFUSED = {"conditions": _conditions("False", "QuotaExceedsCapacity", "False"), "observedGeneration": 1}
MD = {
    "apiVersion": "kvfleet.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "md", "namespace": "ns", "uid": "u"},
}


def _raw(name: str, status: Obj | None = None) -> Obj:
    raw: Obj = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "Tenant",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "generation": 1,
            "resourceVersion": "1",
        },
    }
    if status is not None:
        raw["status"] = status
    return raw


class RecordingClient:
    def __init__(self) -> None:
        self.statuses: list[tuple[str, str]] = []
        self.events: list[tuple[str, str, str]] = []
        self.version = 100

    async def apply_status(self, kind: kinds.Kind, name: str, namespace: str | None, status: Obj) -> Obj:
        await asyncio.sleep(0)
        self.statuses.append((name, _ready_reason(status)))
        self.version += 1
        answer = {**_raw(name), "status": status}
        answer["metadata"] = {**answer["metadata"], "resourceVersion": str(self.version)}
        return answer

    async def create_event(self, namespace: str, event: Obj) -> None:
        self.events.append((event["involvedObject"]["name"], event["type"], event["reason"]))


def _ready_reason(status: Obj) -> str:
    return next(c["reason"] for c in status["conditions"] if c["type"] == "Ready")


def _write(name: str, status: Obj, before: Obj | None = None) -> st.StatusWrite:
    return st.StatusWrite(kinds.TENANT, _raw(name, before), status)


def _with_writer(script: Any, hold: float = 0.2) -> tuple[RecordingClient, list[Obj]]:
    client = RecordingClient()
    observed: list[Obj] = []

    async def go() -> None:
        copy: dict[str, Obj] = {}

        def observe(obj: Obj) -> None:
            observed.append(obj)
            copy[obj["metadata"]["name"]] = obj

        writer = StatusWriter(
            client,  # type: ignore[arg-type]
            observe,
            lambda _ns, name: copy.get(name),
            hold_seconds=hold,
        )
        writer.start()
        await script(writer, client)
        for _ in range(int(hold * 100) + 100):  # until nothing waits, then the writes in flight end
            if not writer.pending:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert writer.pending == 0
        await writer.stop()

    asyncio.run(go())
    return client, observed


def test_a_pool_ready_within_the_hold_costs_one_write_and_one_event() -> None:
    async def script(writer: StatusWriter, client: RecordingClient) -> None:
        for i in range(30):
            writer.submit(_write(f"t{i:02d}", WAITING), MD)
        await asyncio.sleep(0.05)
        for i in range(30):
            writer.submit(_write(f"t{i:02d}", READY), MD)

    client, observed = _with_writer(script)
    assert sorted(client.statuses) == [(f"t{i:02d}", "Ready") for i in range(30)]
    assert client.events == [("md", "Normal", "TenantsReady")]
    assert len(observed) == 30


def test_a_status_that_waits_is_written_when_the_hold_ends() -> None:
    async def script(writer: StatusWriter, client: RecordingClient) -> None:
        writer.submit(_write("t", WAITING), MD)
        await asyncio.sleep(0.1)
        assert client.statuses == []
        writer.submit(_write("t", WAITING), MD)  # computed again: the hold is not extended

    client, _ = _with_writer(script)
    assert client.statuses == [("t", "ModelDeploymentNotReady")]
    assert client.events == [("md", "Normal", "TenantsWaiting")]


def test_a_problem_is_written_at_once_with_its_own_event() -> None:
    async def script(writer: StatusWriter, client: RecordingClient) -> None:
        writer.submit(_write("t", REFUSED), MD)
        await asyncio.sleep(0.05)
        assert client.statuses == [("t", "QuotaExceedsCapacity")]

    client, _ = _with_writer(script, hold=5)
    assert client.events == [("t", "Warning", "QuotaExceedsCapacity")]


def test_an_unchanged_status_cancels_what_waits() -> None:
    async def script(writer: StatusWriter, client: RecordingClient) -> None:
        writer.submit(_write("t", WAITING, before=READY), MD)  # the pool blinked ...
        writer.submit(_write("t", READY, before=READY), MD)  # ... and is back: nothing to write

    client, _ = _with_writer(script)
    assert client.statuses == [] and client.events == []


def test_two_reconciles_that_read_before_either_wrote_write_once() -> None:
    """The second status was computed from the same old read, a second later (another transition
    time): against what the first wrote, it changes nothing."""
    later = {
        **READY,
        "conditions": [{**c, "lastTransitionTime": "2026-01-01T00:00:01Z"} for c in READY["conditions"]],
    }

    async def script(writer: StatusWriter, client: RecordingClient) -> None:
        writer.submit(_write("t", READY), MD)
        await asyncio.sleep(0.05)
        writer.submit(_write("t", later), MD)

    client, _ = _with_writer(script)
    assert client.statuses == [("t", "Ready")]
