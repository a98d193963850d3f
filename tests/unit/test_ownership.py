"""Whose an object is (reconcile/ownership.py): the operator writes only what the owner the builders name
already controls, by uid; labels and names prove nothing."""

from __future__ import annotations

from typing import Any

from kvfleet_operator.api import reasons
from kvfleet_operator.build.common import LABEL_POOL
from kvfleet_operator.reconcile.ownership import (
    NameCollision,
    controlled_by,
    controlled_by_same_owner,
    find_collision,
    name_in_use_problem,
    owned_children,
    split_collisions,
)


def _ref(kind: str, name: str, uid: str, *, controller: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": controller,
    }


def _obj(name: str, *refs: dict[str, Any], kind: str = "Service", pool: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "llm"}
    if refs:
        meta["ownerReferences"] = list(refs)
    if pool is not None:
        meta["labels"] = {LABEL_POOL: pool}
    return {"apiVersion": "v1", "kind": kind, "metadata": meta}


MD = _ref("ModelDeployment", "qwen72b", "uid-md")
DESIRED = _obj("qwen72b-gateway", MD)


def test_a_missing_object_or_one_the_same_owner_controls_is_no_collision() -> None:
    assert find_collision(DESIRED, None) is None
    assert find_collision(DESIRED, _obj("qwen72b-gateway", MD)) is None


def test_an_object_of_another_owner_or_of_none_is_a_collision_naming_it() -> None:
    team = find_collision(DESIRED, _obj("qwen72b-gateway"))
    assert team is not None
    assert (team.kind, team.namespace, team.name, team.pool) == ("Service", "llm", "qwen72b-gateway", None)
    assert "no controller owner" in team.owner
    other = find_collision(DESIRED, _obj("qwen72b-gateway", _ref("Tenant", "bank", "uid-bank")))
    assert other is not None and other.owner == "Tenant bank"
    assert other.describe() == "Service llm/qwen72b-gateway (controlled by Tenant bank)"


def test_same_name_same_kind_another_uid_is_not_the_owner() -> None:
    """A ModelDeployment deleted and created again under its name is a new owner (a new uid)."""
    stale = _obj("qwen72b-gateway", _ref("ModelDeployment", "qwen72b", "uid-before"))
    assert find_collision(DESIRED, stale) is not None


def test_a_non_controller_reference_is_not_control() -> None:
    shared = _obj("qwen72b-gateway", {**MD, "controller": False})
    assert not controlled_by_same_owner(DESIRED, shared)
    assert not controlled_by(shared, "uid-md")
    assert controlled_by(_obj("x", MD), "uid-md") and not controlled_by(_obj("x", MD), "")


def test_only_children_controlled_by_an_owner_are_planned_against_or_pruned() -> None:
    mine = _obj("qwen72b-tenants", MD)
    tenants = _obj("qwen72b-dedicated-bank-engine", _ref("Tenant", "bank", "uid-bank"))
    wearer = _obj("someone-elses")  # wears the labels, owned by nobody
    foreign = _obj("other", _ref("ModelDeployment", "other", "uid-other"))
    assert owned_children([mine, tenants, wearer, foreign], {"uid-md", "uid-bank"}) == [mine, tenants]


def test_a_dedicated_pools_collision_is_its_tenants_and_any_other_the_model_deployments() -> None:
    pool = NameCollision(
        "StatefulSet", "llm", "qwen72b-dedicated-bank-engine", "Tenant acme", "dedicated-bank"
    )
    shared = NameCollision("StatefulSet", "llm", "qwen72b-engine", "ModelDeployment x", "shared")
    config = NameCollision("Secret", "llm", "qwen72b-keys", "nothing", None)
    by_tenant, own = split_collisions([pool, shared, config], {"dedicated-bank": "bank"})
    assert by_tenant == {"bank": [pool]}
    assert own == [shared, config]


def test_the_problem_names_every_object_and_says_nothing_was_written() -> None:
    collisions = [
        NameCollision(
            "Secret", "llm", "stripe-keys", "nothing the operator manages (no controller owner)", None
        ),
        NameCollision("Service", "llm", "stripe-gateway", "Deployment payments", None),
    ]
    update = name_in_use_problem(collisions, "ModelDeployment")
    assert (update.type, update.status, update.reason) == ("Ready", "False", reasons.NAME_IN_USE)
    assert "Secret llm/stripe-keys" in update.message and "Service llm/stripe-gateway" in update.message
    assert "Deployment payments" in update.message
    assert "Nothing of this ModelDeployment was written" in update.message
