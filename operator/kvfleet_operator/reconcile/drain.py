"""Scale-in that drains: the gateways stop sending to the leaving replicas first, the pods go later.

When a pool's desired replicas (``spec.pool.replicas``, which KEDA's HPA writes when autoscaling) fall
below what its engine StatefulSet runs, the reconcile does it in two steps:

1. **Stop sending.** The tenant table lists only the replicas that stay (the gateways and the Endpoint
   Picker see it when the kubelet refreshes their mounted ConfigMap, up to about a minute, then within
   their reload interval), while the StatefulSet keeps running
   the leaving ones, annotated ``kvfleet.io/drain`` with the replicas that stay and since when. A request
   already on a leaving replica finishes there.
2. **Then the pods go.** The first reconcile at least ``grace`` seconds after that (the operator's
   ``KVFLEET_DRAIN_SECONDS``, the chart's ``operator.scaleInDrainSeconds``, 120 s by default: the
   ConfigMap's way to the gateways and a minute of answers; reconciles come at least every
   ``resyncSeconds``) scales the StatefulSet down and drops the annotation. A request still running on a
   leaving replica then is cut, so the grace should exceed the longest answer the platform allows.

Level-triggered: everything is read back from the live StatefulSet (its replicas and annotation), so a
restarted or newly elected operator continues a drain where it was. Scaling back up during a drain ends it
at once (the replicas are still there). Scaling further in restarts the clock: the newly leaving replicas
served until now. Pure: no I/O, the clock is passed in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvfleet_operator.build.common import ANNOTATION_DRAIN

__all__ = [
    "Drain",
    "compute_drain",
    "compute_drains",
    "drain_annotation",
    "parse_drain",
    "serving_ready_replicas",
]


@dataclass(frozen=True)
class Drain:
    """A pool draining: the StatefulSet keeps ``running`` replicas, the table lists ``serving`` of them,
    since ``since`` (RFC 3339, UTC)."""

    running: int
    serving: int
    since: str

    def remaining_s(self, now: str, grace_s: float) -> float:
        return max(0.0, grace_s - (_parse_time(now) - _parse_time(self.since)).total_seconds())


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def drain_annotation(drain: Drain) -> str:
    return json.dumps({"serving": drain.serving, "since": drain.since}, sort_keys=True)


def parse_drain(statefulset: dict[str, Any] | None) -> tuple[int, int | None, str | None]:
    """The live StatefulSet's replicas, and the drain its annotation records (``serving``, ``since``), or
    ``None`` twice when there is none or it cannot be read (then the drain starts again: never shorter)."""
    if statefulset is None:
        return 0, None, None
    replicas = int((statefulset.get("spec") or {}).get("replicas") or 0)
    text = ((statefulset.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_DRAIN)
    if not text:
        return replicas, None, None
    try:
        recorded = json.loads(text)
        serving, since = int(recorded["serving"]), str(recorded["since"])
        _parse_time(since)
    except (TypeError, ValueError, KeyError):
        return replicas, None, None
    return replicas, serving, since


def serving_ready_replicas(statefulset: dict[str, Any] | None) -> int:
    """The replicas of a live engine StatefulSet that are ready and stay: its ``readyReplicas``, never more
    than the replicas a drain keeps in the table (the leaving ones take no new requests)."""
    if statefulset is None:
        return 0
    ready = int((statefulset.get("status") or {}).get("readyReplicas") or 0)
    _, serving, _ = parse_drain(statefulset)
    return ready if serving is None else min(ready, serving)


def compute_drain(desired: int, statefulset: dict[str, Any] | None, now: str, grace_s: float) -> Drain | None:
    """The drain a pool is in, given its desired replicas and its live StatefulSet (``None``: not created
    yet); ``None`` when there is nothing to drain or the grace is over (the StatefulSet goes to
    ``desired``)."""
    running, serving, since = parse_drain(statefulset)
    if running <= desired:
        return None  # steady, scaling out, or scaled back up during a drain
    if serving is None or since is None or desired < serving:
        since = now  # a drain starts (again, for replicas that served until now)
    drain = Drain(running=running, serving=desired, since=since)
    return drain if drain.remaining_s(now, grace_s) > 0 else None


def compute_drains(
    desired: Sequence[dict[str, Any]], live: Sequence[dict[str, Any]], now: str, grace_s: float
) -> dict[str, Drain]:
    """Engine StatefulSet name -> its drain, for every desired StatefulSet whose live one runs more
    replicas than it wants and whose grace is not over."""
    running = {str(o["metadata"]["name"]): o for o in live if o.get("kind") == "StatefulSet"}
    out: dict[str, Drain] = {}
    for obj in desired:
        if obj.get("kind") != "StatefulSet":
            continue
        name = str(obj["metadata"]["name"])
        drain = compute_drain(int(obj["spec"]["replicas"]), running.get(name), now, grace_s)
        if drain is not None:
            out[name] = drain
    return out
