"""Can any node run a pool's engine pods? The scheduling prerequisites as a pure check. Pure.

Engine pods of a shared pool select ``kvfleet.io/gpu-pool=shared`` and, with ``spec.pool.gpuType``, the
GPU Feature Discovery label ``nvidia.com/gpu.product``; they request ``gpusPerReplica`` of the pool's GPU
resource; a dedicated pool requires its group's label and tolerates its taint. Without nodes that fit, the
pods stay Pending and nothing in kvfleet said why. :func:`compute_placement_problems` reads the desired
StatefulSets (what the operator will apply, so the check and the pods can never disagree) and the cluster's
nodes, and says for each pool that no node can take why not: the selector, and per missing label, taint
or resource how many nodes lack it.

It checks what the scheduler checks statically (node selector, required node affinity, NoSchedule and
NoExecute taints, cordoned nodes, allocatable CPU, memory and extended resources), not what is free right
now: a full cluster is a capacity problem, not a missing prerequisite.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from kvfleet_operator.api.units import parse_quantity
from kvfleet_operator.build.common import LABEL_POOL
from kvfleet_operator.build.engine import format_bytes

Obj = dict[str, Any]

#: Taint effects that keep a pod off a node at scheduling time (PreferNoSchedule only discourages).
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
#: Resources counted in bytes (shown as 288Gi rather than a byte count).
BYTE_RESOURCES = frozenset({"memory", "ephemeral-storage"})
#: How many distinct reasons a message lists (most common first).
MAX_REASONS = 6
#: Where a user reads what the nodes need.
PREREQUISITES_DOC = "docs/operations.md, Prerequisites"


def _labels(node: Obj) -> Mapping[str, str]:
    return (node.get("metadata") or {}).get("labels") or {}


def _expression_holds(expr: Obj, labels: Mapping[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], list(expr.get("values") or [])
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in {"Gt", "Lt"}:
        try:
            have, bound = int(labels[key]), int(values[0])
        except (KeyError, IndexError, ValueError):
            return False
        return have > bound if op == "Gt" else have < bound
    return False


def _describe_expression(expr: Obj) -> str:
    key, op, values = expr["key"], expr["operator"], list(expr.get("values") or [])
    if op == "In":
        return f"label {key}={values[0]}" if len(values) == 1 else f"label {key} in ({', '.join(values)})"
    if op == "NotIn":
        return f"label {key} not in ({', '.join(values)})"
    if op == "Exists":
        return f"label {key}"
    if op == "DoesNotExist":
        return f"no label {key}"
    return f"label {key} {'>' if op == 'Gt' else '<'} {values[0] if values else '?'}"


def _affinity_unmet(pod: Obj, labels: Mapping[str, str]) -> list[str]:
    """What the closest required node-affinity term lacks (terms are ORed): nothing when one holds."""
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if not required:
        return []
    best: list[str] | None = None
    for term in required.get("nodeSelectorTerms") or []:
        unmet = [
            f"lack {_describe_expression(e)}"
            for e in term.get("matchExpressions") or []
            if not _expression_holds(e, labels)
        ]
        if not unmet:
            return []
        if best is None or len(unmet) < len(best):
            best = unmet
    return best or []


def _tolerates(tolerations: Sequence[Obj], taint: Obj) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t["key"] == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def resource_amount(text: Any) -> Decimal:
    """A resource quantity as a number (CPU in cores, with milli; everything else through the byte
    parser, which also reads plain counts)."""
    value = str(text)
    try:
        if value.endswith("m"):
            return Decimal(value[:-1]) / 1000
        return Decimal(parse_quantity(value))
    except (ValueError, InvalidOperation):
        return Decimal(0)


def _resources_unmet(pod: Obj, node: Obj) -> list[str]:
    wanted: dict[str, Decimal] = {}
    for container in pod.get("containers") or []:
        for name, amount in ((container.get("resources") or {}).get("requests") or {}).items():
            wanted[name] = wanted.get(name, Decimal(0)) + resource_amount(amount)
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    unmet = []
    for name, amount in sorted(wanted.items()):
        if amount <= 0:
            continue
        have = resource_amount(allocatable[name]) if name in allocatable else Decimal(0)
        if have < amount:
            unmet.append(
                f"have no {name}"
                if name not in allocatable
                else f"have less {name} than {_fmt(name, amount)}"
            )
    return unmet


def _fmt(resource: str, amount: Decimal) -> str:
    if resource in BYTE_RESOURCES:
        return format_bytes(int(amount))
    return format(amount.normalize(), "f")


def compute_unmet(pod: Obj, node: Obj) -> list[str]:
    """Why ``node`` cannot run ``pod`` (a pod spec), each as a phrase completing "nodes ...": empty when
    it can."""
    labels = _labels(node)
    unmet = [
        f"lack label {key}={value}"
        for key, value in sorted((pod.get("nodeSelector") or {}).items())
        if labels.get(key) != value
    ]
    unmet += _affinity_unmet(pod, labels)
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        unmet.append("are cordoned (unschedulable)")
    tolerations = pod.get("tolerations") or []
    for taint in spec.get("taints") or []:
        if taint.get("effect") in BLOCKING_EFFECTS and not _tolerates(tolerations, taint):
            value = f"={taint['value']}" if taint.get("value") else ""
            unmet.append(f"have taint {taint.get('key')}{value}:{taint.get('effect')} not tolerated")
    return unmet + _resources_unmet(pod, node)


def _wants(pod: Obj) -> str:
    """What the pods ask of a node, for the message."""
    parts = []
    selector = pod.get("nodeSelector") or {}
    if selector:
        parts.append("nodeSelector " + ", ".join(f"{k}={v}" for k, v in sorted(selector.items())))
    requests = ((pod.get("containers") or [{}])[0].get("resources") or {}).get("requests") or {}
    extended = {k: v for k, v in sorted(requests.items()) if "/" in k and str(v) not in {"0", ""}}
    if extended:
        parts.append("requests " + ", ".join(f"{k}: {v}" for k, v in extended.items()))
    return "; ".join(parts) or "no node selector"


def explain_no_node(pod: Obj, nodes: Sequence[Obj], what: str) -> str | None:
    """``None`` when some node can run ``pod``; else a message naming ``what`` (the pool), what its pods
    ask for, and how many nodes lack each label, taint or resource."""
    if not nodes:
        return f"No node can run {what}: the cluster has no nodes. See {PREREQUISITES_DOC}."
    reasons: Counter[str] = Counter()
    for node in nodes:
        unmet = compute_unmet(pod, node)
        if not unmet:
            return None
        reasons.update(set(unmet))
    ranked = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
    listed = "; ".join(f"{count} {reason}" for reason, count in ranked[:MAX_REASONS])
    more = f"; and {len(ranked) - MAX_REASONS} more reasons" if len(ranked) > MAX_REASONS else ""
    return (
        f"No node can run {what} ({_wants(pod)}). Of {len(nodes)} node(s): {listed}{more}. Label, taint "
        f"or equip the GPU nodes as {PREREQUISITES_DOC} says; the pods stay Pending until one fits."
    )


def compute_placement_problems(
    desired: Iterable[Obj], nodes: Sequence[Obj], dedicated_to: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Pool name -> why no node can run its engine pods, for each desired engine StatefulSet that no node
    fits (pools that fit are absent). ``dedicated_to``: pool -> the Tenant that owns it, for the message."""
    owners = dedicated_to or {}
    problems: dict[str, str] = {}
    for obj in desired:
        if obj.get("kind") != "StatefulSet":
            continue
        pool = str(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_POOL, ""))
        pod = obj["spec"]["template"]["spec"]
        name = obj["metadata"]["name"]
        what = (
            f"the engine pods of Tenant {owners[pool]!r}'s dedicated pool (StatefulSet {name})"
            if pool in owners
            else f"the engine pods of pool {pool!r} (StatefulSet {name})"
        )
        problem = explain_no_node(pod, nodes, what)
        if problem is not None:
            problems[pool] = problem
    return problems
