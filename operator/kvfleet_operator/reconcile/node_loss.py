"""Which engine pods of a lost node the operator force-deletes, and when (pure).

An engine pod belongs to a StatefulSet, which never starts a second pod of a name while the first may
still run. When a node stops reporting, the node lifecycle controller taints it
``node.kubernetes.io/unreachable:NoExecute`` and marks its pods ``Ready=False`` (so they leave the
Service's endpoints), and its taint-eviction controller deletes each pod once its toleration (30 s,
``build/engine.py``) runs out, with the condition ``DisruptionTarget`` (reason ``DeletionByTaintManager``)
on the pod. Nobody confirms that deletion (the kubelet is gone): the pod stays ``Terminating`` and the
replica never comes back until a human taints the node out-of-service.

An inference engine holds no durable state (its KV cache is a cache) and the evicted pod is already out of
the endpoints, so the gateway cannot reach it even if the machine still runs. The operator therefore
force-deletes such a pod itself once its deletion grace period plus ``spec.pool.nodeLoss.after`` has
passed, with a precondition on the pod's uid (a new pod of the same name is never deleted). A pod with an
NVMe claim is held: its local volume is bound to the lost node, so a replacement could not run elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Final

Obj = dict[str, Any]

#: The condition the taint-eviction controller puts on a pod it deletes (k8s.io/api core/v1
#: ``DisruptionTarget``; reason ``DeletionByTaintManager``, pkg/controller/tainteviction).
DISRUPTION_TARGET: Final = "DisruptionTarget"
DELETION_BY_TAINT_MANAGER: Final = "DeletionByTaintManager"

#: Event reasons (on the ModelDeployment).
ENGINE_POD_REPLACED: Final = "EnginePodReplaced"
ENGINE_POD_STUCK_ON_LOST_NODE: Final = "EnginePodStuckOnLostNode"


class Verdict(StrEnum):
    #: Force-delete now: the StatefulSet starts the replacement.
    REPLACE = "replace"
    #: Lost, but the wait (grace period + ``after``) has not passed yet.
    WAIT = "wait"
    #: Lost, but not replaced: replacement is off, or the pod's volume cannot move.
    HOLD = "hold"


@dataclass(frozen=True)
class LostPod:
    """An engine pod evicted from a lost node, and what to do with it."""

    name: str
    uid: str
    node: str
    verdict: Verdict
    #: Seconds until it is replaced (``WAIT``), else 0.
    remaining_s: float
    message: str


def _condition(pod: Obj, kind: str) -> Obj:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), {})


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def evicted_from_lost_node(pod: Obj, node_ready: Mapping[str, str] | None) -> bool:
    """Whether ``pod`` is being deleted because its node was lost: the taint-eviction controller deleted it
    (``DisruptionTarget`` True, reason ``DeletionByTaintManager``), the node lifecycle controller marked it
    not ready, and, where the nodes could be read (``node_ready``: node name -> its Ready status), its node
    is gone or not Ready. A pod whose kubelet is alive finishes its own termination: never forced."""
    meta = pod.get("metadata") or {}
    if not meta.get("deletionTimestamp") or not meta.get("uid"):
        return False
    target = _condition(pod, DISRUPTION_TARGET)
    if target.get("status") != "True" or target.get("reason") != DELETION_BY_TAINT_MANAGER:
        return False
    if _condition(pod, "Ready").get("status") == "True":
        return False
    node = str((pod.get("spec") or {}).get("nodeName") or "")
    return node_ready is None or node_ready.get(node) != "True"


def decide_lost_engine_pods(
    pods: Sequence[Obj],
    now: datetime,
    replace: bool,
    after_s: float,
    volume_bound: bool,
    node_ready: Mapping[str, str] | None = None,
) -> list[LostPod]:
    """One :class:`LostPod` for each of ``pods`` (the ModelDeployment's engine pods) evicted from a lost
    node (:func:`evicted_from_lost_node`), in name order. ``REPLACE`` once ``now`` is ``after_s`` past
    the pod's ``deletionTimestamp`` (which the API server set to the eviction time plus the pod's grace
    period), ``WAIT`` before; ``HOLD`` when ``replace`` is off or ``volume_bound`` (the pods mount an NVMe
    claim, bound to the lost node)."""
    lost: list[LostPod] = []
    for pod in sorted(pods, key=lambda p: str(p["metadata"]["name"])):
        if not evicted_from_lost_node(pod, node_ready):
            continue
        meta = pod["metadata"]
        name, uid = str(meta["name"]), str(meta["uid"])
        node = str(pod["spec"].get("nodeName") or "")
        due = _parse_time(str(meta["deletionTimestamp"])) + timedelta(seconds=after_s)
        where = f"engine pod {name} was evicted from node {node}, which stopped reporting"
        if volume_bound:
            verdict, remaining = Verdict.HOLD, 0.0
            message = (
                f"{where}; it is not replaced: its NVMe claim (kvCache.nvme.storageClassName) is a local "
                "volume bound to that node. Bring the node back, or delete the claim and the pod to "
                "start the replica elsewhere with an empty NVMe tier."
            )
        elif not replace:
            verdict, remaining = Verdict.HOLD, 0.0
            message = (
                f"{where}; it is not replaced (spec.pool.nodeLoss.replace is false) until the node is "
                "confirmed down (taint it node.kubernetes.io/out-of-service) or comes back."
            )
        elif now >= due:
            verdict, remaining = Verdict.REPLACE, 0.0
            message = (
                f"{where}; force-deleted {after_s:g}s after its grace period ended so that the "
                "StatefulSet starts its replacement (it was already out of the Service's endpoints)."
            )
        else:
            verdict, remaining = Verdict.WAIT, (due - now).total_seconds()
            message = f"{where}; replaced in {remaining:.0f}s unless the node comes back."
        lost.append(LostPod(name, uid, node, verdict, remaining, message))
    return lost


def node_loss_event(md: Obj, reason: str, pod: LostPod, now: str) -> Obj:
    """The Event on the ModelDeployment that tells what happened to ``pod`` (``kubectl describe md``)."""
    meta = md.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
        "involvedObject": {
            "apiVersion": md.get("apiVersion"),
            "kind": md.get("kind"),
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
        },
        "type": "Warning",
        "reason": reason,
        "message": pod.message[:1024],
        "source": {"component": "kvfleet-operator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
