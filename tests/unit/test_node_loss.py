"""Which engine pods of a lost node the operator force-deletes, and when (reconcile/node_loss.py).

The pods are shaped as the real API server shows them after the node lifecycle controller and its
taint-eviction controller acted (tests/cluster/test_node_not_ready.py runs that for real).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfleet_operator.api import ModelDeployment
from kvfleet_operator.api.modeldeployment import DEFAULT_NODE_LOSS_AFTER, NodeLossSpec
from kvfleet_operator.reconcile.node_loss import (
    DELETION_BY_TAINT_MANAGER,
    DISRUPTION_TARGET,
    ENGINE_POD_REPLACED,
    Verdict,
    decide_lost_engine_pods,
    evicted_from_lost_node,
    node_loss_event,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "modeldeployment-qwen72b.yaml"

#: When the pod's deletion grace period ended (its deletionTimestamp).
DELETED = datetime(2026, 12, 1, 4, 0, 0, tzinfo=UTC)


def _pod(
    name: str = "qwen72b-shared-1",
    uid: str = "uid-1",
    node: str = "gpu-lost",
    *,
    deleting: bool = True,
    disruption: tuple[str, str] | None = ("True", DELETION_BY_TAINT_MANAGER),
    ready: str = "False",
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": ready}]
    if disruption is not None:
        status, reason = disruption
        conditions.append({"type": DISRUPTION_TARGET, "status": status, "reason": reason})
    meta: dict[str, Any] = {"name": name, "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = DELETED.isoformat().replace("+00:00", "Z")
    return {
        "metadata": meta,
        "spec": {"nodeName": node},
        "status": {"phase": "Running", "conditions": conditions},
    }


def _decide(pods: list[dict[str, Any]], after_deleted_s: float, **kw: Any) -> list[tuple[str, Verdict]]:
    args: dict[str, Any] = {"replace": True, "after_s": 60.0, "volume_bound": False, **kw}
    lost = decide_lost_engine_pods(pods, DELETED + timedelta(seconds=after_deleted_s), **args)
    return [(p.name, p.verdict) for p in lost]


def test_an_evicted_pod_waits_then_is_replaced_after_the_grace_period_plus_after() -> None:
    pod = _pod()
    (waiting,) = decide_lost_engine_pods([pod], DELETED + timedelta(seconds=20), True, 60.0, False)
    assert waiting.verdict is Verdict.WAIT and waiting.remaining_s == pytest.approx(40)
    assert _decide([pod], 59.9) == [("qwen72b-shared-1", Verdict.WAIT)]
    (due,) = decide_lost_engine_pods([pod], DELETED + timedelta(seconds=60), True, 60.0, False)
    assert (due.verdict, due.uid, due.node) == (Verdict.REPLACE, "uid-1", "gpu-lost")
    assert "force-deleted" in due.message and "gpu-lost" in due.message


@pytest.mark.parametrize(
    "pod",
    [
        _pod(deleting=False),  # not being deleted: a NotReady pod the node may still bring back
        _pod(disruption=None),  # deleted by someone else (a scale-down, a user): its kubelet confirms
        _pod(disruption=("True", "EvictionByEvictionAPI")),  # a drain: the kubelet is alive
        _pod(disruption=("False", DELETION_BY_TAINT_MANAGER)),
        _pod(ready="True"),  # its kubelet still reports it ready
    ],
    ids=["not-deleting", "no-disruption", "drained", "disruption-false", "ready"],
)
def test_only_a_pod_the_taint_manager_evicted_from_a_lost_node_counts(pod: dict[str, Any]) -> None:
    assert not evicted_from_lost_node(pod, None)
    assert _decide([pod], 3600) == []


def test_a_pod_whose_node_is_ready_again_is_never_forced() -> None:
    pod = _pod()
    assert evicted_from_lost_node(pod, None)  # nodes unreadable (rbac.readNodes off): the pod's own word
    assert evicted_from_lost_node(pod, {"gpu-lost": "Unknown"})
    assert evicted_from_lost_node(pod, {})  # the Node object is gone (a cloud deleted the machine)
    assert not evicted_from_lost_node(pod, {"gpu-lost": "True"})  # its kubelet finishes the deletion
    assert _decide([pod], 3600, node_ready={"gpu-lost": "True"}) == []


def test_replace_off_or_a_local_volume_holds_the_pod_with_a_reason() -> None:
    (off,) = decide_lost_engine_pods([_pod()], DELETED + timedelta(hours=1), False, 60.0, False)
    assert off.verdict is Verdict.HOLD and "nodeLoss.replace is false" in off.message
    assert "out-of-service" in off.message
    (bound,) = decide_lost_engine_pods([_pod()], DELETED + timedelta(hours=1), True, 60.0, True)
    assert bound.verdict is Verdict.HOLD and "local volume bound to that node" in bound.message


def test_only_the_lost_pods_in_name_order_and_each_with_its_own_uid() -> None:
    pods = [
        _pod("md-shared-2", "uid-2"),
        _pod("md-shared-0", "uid-0", node="gpu-ok", deleting=False, disruption=None, ready="True"),
        _pod("md-shared-1", "uid-1"),
    ]
    lost = decide_lost_engine_pods(pods, DELETED + timedelta(seconds=61), True, 60.0, False)
    assert [(p.name, p.uid) for p in lost] == [("md-shared-1", "uid-1"), ("md-shared-2", "uid-2")]


def test_after_zero_replaces_as_soon_as_the_grace_period_ended() -> None:
    assert _decide([_pod()], -0.1, after_s=0.0) == [("qwen72b-shared-1", Verdict.WAIT)]
    assert _decide([_pod()], 0, after_s=0.0) == [("qwen72b-shared-1", Verdict.REPLACE)]


def test_the_spec_field_defaults_to_replacing_after_60s() -> None:
    tiny_md: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    md = ModelDeployment.model_validate(tiny_md)
    assert md.spec.pool.node_loss == NodeLossSpec(replace=True, after=DEFAULT_NODE_LOSS_AFTER)
    assert DEFAULT_NODE_LOSS_AFTER == "60s"
    tiny_md["spec"]["pool"]["nodeLoss"] = {"replace": False, "after": "2m"}
    custom = ModelDeployment.model_validate(tiny_md).spec.pool.node_loss
    assert (custom.replace, custom.after) == (False, "2m")
    tiny_md["spec"]["pool"]["nodeLoss"] = {"after": "soon"}
    with pytest.raises(ValidationError, match="after"):
        ModelDeployment.model_validate(tiny_md)


def test_the_event_names_the_model_deployment_and_says_what_happened() -> None:
    md = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "qwen72b", "namespace": "llm", "uid": "md-uid"},
    }
    (pod,) = decide_lost_engine_pods([_pod()], DELETED + timedelta(seconds=61), True, 60.0, False)
    event = node_loss_event(md, ENGINE_POD_REPLACED, pod, "2026-12-01T04:01:01Z")
    assert event["involvedObject"] == {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "name": "qwen72b",
        "namespace": "llm",
        "uid": "md-uid",
    }
    assert (event["type"], event["reason"], event["metadata"]["namespace"]) == (
        "Warning",
        ENGINE_POD_REPLACED,
        "llm",
    )
    assert event["message"] == pod.message
