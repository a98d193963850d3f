"""Whose an object is: the operator writes only what its owner already controls. Pure.

Children are named from the ModelDeployment's (and a dedicated tenant's) name, so a name can be taken
before the operator gets to it: by anything of the namespace (a team's Secret ``stripe-keys``) or by
another ModelDeployment's or Tenant's child (MD ``qwen72b-dedicated-bank``'s shared pool has the names of
MD ``qwen72b``'s pool for tenant ``bank``). Labels prove nothing (anyone who may write an object may set
them); a controller owner reference with the owner's uid does: only the owner's creator sets it, and the
garbage collector acts on it.

So an object the operator would write must either not exist yet, or be controlled (a ``controller: true``
owner reference) by the object the builders make it owned by, uid included: the ModelDeployment for its
own children, the Tenant for a dedicated pool. Anything else is a :class:`NameCollision`: reported
(``NameInUse``) and never written. A child of a dedicated tenant's pool (``kvfleet.io/pool`` other than the
shared one) is that tenant's problem only: the tenant is left out and the rest is served. Any other
collision stops the whole ModelDeployment's writes (:func:`split_collisions`). Listing children by label
is a lookup, never a grant: a listed object that is not controlled by its owner is neither planned
against nor pruned (:func:`owned_children`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet_operator.api import reasons
from kvfleet_operator.build.common import LABEL_POOL, SHARED_POOL
from kvfleet_operator.reconcile.conditions import ConditionUpdate
from kvfleet_operator.reconcile.status import problem

Obj = dict[str, Any]


def controller_reference(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The object's controller owner reference (``controller: true``), or ``None``."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            found: Mapping[str, Any] = ref
            return found
    return None


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    ref = controller_reference(obj)
    return str(ref.get("uid") or "") or None if ref is not None else None


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether ``obj``'s controller owner reference has ``uid`` (never for an empty ``uid``)."""
    return bool(uid) and _controller_uid(obj) == uid


def controlled_by_same_owner(desired: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """Whether ``live`` is controlled by the owner ``desired`` names (same uid): the operator may write it."""
    want = _controller_uid(desired)
    return want is not None and _controller_uid(live) == want


def owned_children(listed: Iterable[Obj], owner_uids: Iterable[str]) -> list[Obj]:
    """The listed objects controlled by one of ``owner_uids`` (the ModelDeployment and its tenants): the
    only objects the plan applies over or prunes. An object that merely wears the labels is left alone."""
    uids = set(owner_uids)
    return [obj for obj in listed if (_controller_uid(obj) or "") in uids]


def describe_owner(live: Mapping[str, Any]) -> str:
    """Who controls ``live``, for the message: ``Tenant bank`` or ``no kvfleet owner``-like words."""
    ref = controller_reference(live)
    if ref is None:
        return "nothing the operator manages (no controller owner)"
    return f"{ref.get('kind')} {ref.get('name')}"


@dataclass(frozen=True)
class NameCollision:
    """A desired object whose name is in use by an object its owner does not control."""

    kind: str
    namespace: str
    name: str
    owner: str
    #: The engine pool the desired object belongs to (``kvfleet.io/pool``), or ``None``.
    pool: str | None

    def describe(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name} (controlled by {self.owner})"


def find_collision(desired: Obj, live: Obj | None) -> NameCollision | None:
    """The collision, when ``live`` (the object of ``desired``'s kind and name, ``None`` if there is none)
    exists and is not controlled by the owner ``desired`` names."""
    if live is None or controlled_by_same_owner(desired, live):
        return None
    meta = desired["metadata"]
    return NameCollision(
        kind=str(desired["kind"]),
        namespace=str(meta.get("namespace") or ""),
        name=str(meta["name"]),
        owner=describe_owner(live),
        pool=(meta.get("labels") or {}).get(LABEL_POOL),
    )


def split_collisions(
    collisions: Sequence[NameCollision], dedicated_pools: Mapping[str, str]
) -> tuple[dict[str, list[NameCollision]], list[NameCollision]]:
    """(tenant -> its collisions, the ModelDeployment's own). ``dedicated_pools``: pool -> its tenant.

    A collision of a dedicated pool's object is its tenant's; any other (the gateway, config, keys, the
    shared pool, the shared tier, monitoring) is the ModelDeployment's."""
    by_tenant: dict[str, list[NameCollision]] = {}
    own: list[NameCollision] = []
    for collision in collisions:
        tenant = dedicated_pools.get(collision.pool or "") if collision.pool != SHARED_POOL else None
        if tenant is None:
            own.append(collision)
        else:
            by_tenant.setdefault(tenant, []).append(collision)
    return by_tenant, own


_FIX = (
    "The operator never writes over an object it does not control: delete or rename the object in the "
    "way (if it is not needed), or rename this {what}."
)


def name_in_use_problem(collisions: Sequence[NameCollision], what: str) -> ConditionUpdate:
    """``NameInUse`` naming each object in the way and its owner; ``what``: ``ModelDeployment`` (nothing of
    it was written) or ``Tenant`` (nothing of this tenant was)."""
    listed = "; ".join(c.describe() for c in collisions)
    return problem(
        reasons.NAME_IN_USE,
        f"Name(s) in use: {listed}. Nothing of this {what} was written. " + _FIX.format(what=what),
    )
