"""Plan what to change: desired children against the children that exist. Pure.

A child needs an apply only when some field the operator sets differs from the live object; fields the
API server defaults or other controllers own are ignored. So a second reconcile of a converged object
plans nothing, and the shell makes zero mutating calls. Builders must therefore emit fields in the
form the server stores them (canonical quantities, ``data`` not ``stringData`` for Secrets).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

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


def is_subset(desired: Any, live: Any) -> bool:
    """Whether every field in ``desired`` has the same value in ``live`` (recursively).

    A field missing from ``live`` matches a zero value in ``desired``, because the server drops zero
    values of ``omitempty`` fields when it stores an object.
    """
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        return all(
            is_subset(value, live[key]) if key in live else _is_go_zero(value)
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return False
        return all(is_subset(d, lv) for d, lv in zip(desired, live, strict=True))
    return bool(desired == live)


def _is_go_zero(value: Any) -> bool:
    """The API server omits zero values (``omitempty``): ``false``, ``0``, ``""``, ``[]``, ``{}``."""
    return value is False or value == 0 or value in ("", [], {})


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
        if _key(obj) not in live or not is_subset(obj, live[_key(obj)])
    ]
    deletes = [
        Action("delete", kind_of(obj), obj["metadata"].get("namespace"), obj["metadata"]["name"])
        for key, obj in live.items()
        if key not in wanted
    ]
    applies.sort(key=lambda a: _order(a.kind))
    deletes.sort(key=lambda a: -_order(a.kind))
    return applies + deletes
