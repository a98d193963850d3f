"""The operator's watch-fed copies (operator/kvfleet_operator/k8s/informer.py), against a scripted client:
a list, then watch streams; what the copy holds after each, what ``on_change`` hears, and that the
operator's own writes (``observe``) neither go back in time nor bring a deleted object back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.informer import Informer, is_newer, slim

Obj = dict[str, Any]


def _tenant(name: str, version: int, ref: str = "md", namespace: str = "ns") -> Obj:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "resourceVersion": str(version),
            "managedFields": [{"manager": "x"}],
        },
        "spec": {"modelDeploymentRef": {"name": ref}},
    }


class ScriptedClient:
    """``list_versioned`` answers the lists in order; ``watch`` plays the streams in order, then waits."""

    def __init__(self, lists: list[tuple[list[Obj], str]], streams: list[list[Obj]]) -> None:
        self.lists, self.streams = lists, streams
        self.watched_from: list[str] = []
        self.done = asyncio.Event()

    async def list_versioned(
        self,
        kind: kinds.Kind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        page: int | None = None,
    ) -> tuple[list[Obj], str]:
        return self.lists.pop(0)

    async def watch(
        self,
        kind: kinds.Kind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        resource_version: str,
        timeout_seconds: int,
    ) -> AsyncIterator[Obj]:
        self.watched_from.append(resource_version)
        if not self.streams:
            self.done.set()
            await asyncio.Event().wait()
        for event in self.streams.pop(0):
            yield event


def _run(client: ScriptedClient, changes: list[tuple[str | None, str | None]]) -> Informer:
    async def go() -> Informer:
        def on_change(old: Obj | None, new: Obj | None) -> None:
            changes.append(
                (
                    old["metadata"]["resourceVersion"] if old else None,
                    new["metadata"]["resourceVersion"] if new else None,
                )
            )

        informer = Informer(client, kinds.TENANT, ["ns"], on_change=on_change)  # type: ignore[arg-type]
        informer.start()
        await informer.wait_synced()
        await asyncio.wait_for(client.done.wait(), 5)
        await informer.stop()
        return informer

    return asyncio.run(go())


def test_list_then_watch_keeps_the_latest_and_reports_each_change() -> None:
    client = ScriptedClient(
        [([_tenant("a", 1), _tenant("b", 2)], "2")],
        [
            [
                {"type": "MODIFIED", "object": _tenant("a", 3)},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "4"}}},
                {"type": "DELETED", "object": _tenant("b", 5)},
                {"type": "ADDED", "object": _tenant("c", 6)},
            ]
        ],
    )
    changes: list[tuple[str | None, str | None]] = []
    informer = _run(client, changes)
    assert [o["metadata"]["name"] for o in informer.list("ns")] == ["a", "c"]
    assert informer.get("ns", "a") == {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": "a", "namespace": "ns", "resourceVersion": "3"},
        "spec": {"modelDeploymentRef": {"name": "md"}},
    }
    # The initial list reports nothing (every ModelDeployment is reconciled at start anyway).
    assert changes == [("1", "3"), ("2", None), (None, "6")]
    assert client.watched_from == ["2", "6"]  # resumed from the last version seen


def test_an_expired_watch_lists_again_and_reports_what_changed_meanwhile() -> None:
    gone = {"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "too old"}}
    client = ScriptedClient(
        [([_tenant("a", 1), _tenant("b", 2)], "2"), ([_tenant("a", 7), _tenant("d", 8)], "8")],
        [[gone]],
    )
    changes: list[tuple[str | None, str | None]] = []
    informer = _run(client, changes)
    assert [o["metadata"]["name"] for o in informer.list()] == ["a", "d"]
    assert sorted(changes, key=str) == sorted([("2", None), ("1", "7"), (None, "8")], key=str)
    assert client.watched_from == ["2", "8"]


def test_an_own_write_never_goes_back_in_time_nor_resurrects() -> None:
    client = ScriptedClient(
        [([_tenant("a", 5), _tenant("b", 6)], "6")],
        [[{"type": "DELETED", "object": _tenant("b", 9)}]],
    )
    informer = _run(client, [])
    informer.observe(_tenant("a", 4))  # an answer older than what the watch brought
    assert informer.get("ns", "a") is not None
    assert informer.get("ns", "a")["metadata"]["resourceVersion"] == "5"  # type: ignore[index]
    informer.observe(_tenant("a", 10))
    assert informer.get("ns", "a")["metadata"]["resourceVersion"] == "10"  # type: ignore[index]
    informer.observe(_tenant("b", 7))  # answered after the deletion was seen
    assert informer.get("ns", "b") is None
    informer.observe(_tenant("x", 3, namespace="elsewhere"))  # not a watched namespace
    assert informer.list() == [informer.get("ns", "a")]


def test_secrets_only_through_a_label_selector() -> None:
    with pytest.raises(ValueError, match="label selector"):
        Informer(ScriptedClient([], []), kinds.SECRET, [None])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("candidate", "current", "newer"),
    [("5", "4", True), ("4", "5", False), ("5", "5", True), ("abc", "5", True), ("5", None, True)],
)
def test_is_newer(candidate: str, current: str | None, newer: bool) -> None:
    old = None if current is None else {"metadata": {"resourceVersion": current}}
    assert is_newer({"metadata": {"resourceVersion": candidate}}, old) is newer


def test_slim_drops_managed_fields_only() -> None:
    assert slim(_tenant("a", 1))["metadata"] == {"name": "a", "namespace": "ns", "resourceVersion": "1"}


def test_the_watch_event_of_an_own_write_is_no_news() -> None:
    """A version the copy holds already (the operator's own write, observed from the API server's answer
    before its watch event came) is not reported again; a later version of the same object is."""

    async def go() -> tuple[Informer, list[tuple[str | None, str | None]]]:
        changes: list[tuple[str | None, str | None]] = []
        release = asyncio.Event()
        client = ScriptedClient([([_tenant("a", 1)], "1")], [])

        async def watch(*_: Any, **__: Any) -> AsyncIterator[Obj]:
            await release.wait()
            for event in (
                {"type": "ADDED", "object": _tenant("b", 2)},  # created by the operator: observed below
                {"type": "MODIFIED", "object": _tenant("a", 3)},  # the operator's write, observed
                {"type": "MODIFIED", "object": _tenant("a", 4)},  # someone else's, later
            ):
                yield event
            client.done.set()
            await asyncio.Event().wait()

        client.watch = watch  # type: ignore[method-assign]
        informer = Informer(
            client,  # type: ignore[arg-type]
            kinds.TENANT,
            ["ns"],
            on_change=lambda old, new: changes.append(
                (
                    old["metadata"]["resourceVersion"] if old else None,
                    new["metadata"]["resourceVersion"] if new else None,
                )
            ),
        )
        informer.start()
        await informer.wait_synced()
        informer.observe(_tenant("b", 2))
        informer.observe(_tenant("a", 3))
        release.set()
        await asyncio.wait_for(client.done.wait(), 5)
        await informer.stop()
        return informer, changes

    informer, changes = asyncio.run(go())
    assert changes == [("3", "4")]
    assert informer.get("ns", "a")["metadata"]["resourceVersion"] == "4"  # type: ignore[index]
    assert informer.get("ns", "b") is not None
