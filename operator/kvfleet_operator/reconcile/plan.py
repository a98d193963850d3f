"""Plan what to change: desired children against the children that exist. Pure.

A child needs an apply when a field the operator sets is missing from the live object or differs there;
fields the API server defaults or other controllers own are ignored. So a second reconcile of a
converged object plans nothing, and the shell makes zero mutating calls; and every field the operator
sets is restored when someone removes it, ``false``, ``0`` and ``""`` included (deleting
``allowPrivilegeEscalation: false`` from a live pod template is drift like any other). Builders must
therefore emit fields in the form the server stores them (canonical quantities, ``data`` not
``stringData`` for Secrets, no empty maps); the only zero values the server drops on its own are listed in
:data:`SERVER_OMITS_ZERO`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvfleet_operator.k8s.kinds import CHILD_KINDS, Kind, kind_of

Obj = dict[str, Any]


@dataclass(frozen=True)
class Action:
    verb: Literal["apply", "delete"]
    kind: Kind
    namespace: str | None
    name: str
    obj: Obj | None = None

    def describe(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.verb} {self.kind.kind} {where}"


_TOLERATION = ("key", "operator", "value", "effect")

#: Fields the API server does not store when they hold their zero value (``false``, ``0``, ``""``): the
#: non-pointer ``omitempty`` fields of the Kubernetes types, among those the builders emit. Found by
#: applying every child to the real API server and reading it back (tests/security/test_drift_repair.py
#: checks that a converged object plans nothing and that every other field removed is restored). Paths
#: are dotted from the object's root; ``*`` is any item of a list. Any other field, zero or not, must be
#: present in the live object.
SERVER_OMITS_ZERO: Final[Mapping[str, Set[str]]] = {
    "Service": frozenset({"spec.publishNotReadyAddresses"}),
    "StatefulSet": frozenset(f"spec.template.spec.tolerations.*.{f}" for f in _TOLERATION),
    "Deployment": frozenset(f"spec.template.spec.tolerations.*.{f}" for f in _TOLERATION),
}


def is_subset(desired: Any, live: Any, omits_zero: Set[str] = frozenset(), path: str = "") -> bool:
    """Whether every field in ``desired`` is present in ``live`` with the same value (recursively).

    A field missing from ``live`` matches only an empty list in ``desired`` (Kubernetes cannot tell an
    empty list from none: the server stores neither), or a zero value at a path in ``omits_zero`` (where
    the server drops zero values: :data:`SERVER_OMITS_ZERO`). ``path`` is where ``desired`` sits.
    """
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        for key, value in desired.items():
            here = f"{path}.{key}" if path else str(key)
            if key in live:
                if not is_subset(value, live[key], omits_zero, here):
                    return False
            elif not (value == [] or (here in omits_zero and _is_zero(value))):
                return False
        return True
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return False
        return all(is_subset(d, lv, omits_zero, f"{path}.*") for d, lv in zip(desired, live, strict=True))
    return bool(desired == live)


def _is_zero(value: Any) -> bool:
    return value is False or value == "" or (type(value) is int and value == 0)


def _key(obj: Obj) -> tuple[str, str, str | None, str]:
    meta = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])


def _order(kind: Kind) -> int:
    return CHILD_KINDS.index(kind)


def compute_plan(desired: Sequence[Obj], existing: Iterable[Obj]) -> list[Action]:
    """Applies for desired objects that are missing or differ, deletes for owned objects not desired.

    ``existing`` must hold only objects this owner manages (selected by the owner label). Applies come
    in dependency order (config before workloads); deletes after them, in reverse order.
    """
    live = {_key(obj): obj for obj in existing}
    wanted = {_key(obj) for obj in desired}
    applies = [
        Action("apply", kind_of(obj), obj["metadata"].get("namespace"), obj["metadata"]["name"], obj)
        for obj in desired
        if _key(obj) not in live
        or not is_subset(obj, live[_key(obj)], SERVER_OMITS_ZERO.get(obj["kind"], frozenset()))
    ]
    deletes = [
        Action("delete", kind_of(obj), obj["metadata"].get("namespace"), obj["metadata"]["name"])
        for key, obj in live.items()
        if key not in wanted
    ]
    applies.sort(key=lambda a: _order(a.kind))
    deletes.sort(key=lambda a: -_order(a.kind))
    return applies + deletes
