"""Who owns a dedicated GPU group (build/gpu_groups.py): the oldest claimant in any watched namespace,
stable until it is deleted; every other claimant is refused with a message naming the owner."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_operator.api import Tenant
from kvfleet_operator.build.gpu_groups import (
    GroupClaim,
    gpu_group_claims,
    gpu_group_owners,
    refused_claimants,
    tolerates_gpu_groups,
)


def _raw(
    name: str, namespace: str, created: str, group: str | None = "bank-h200", **meta: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {"modelDeploymentRef": {"name": "qwen"}}
    if group is not None:
        spec |= {"isolation": "dedicated", "dedicated": {"gpuGroup": group}}
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created, **meta},
        "spec": spec,
    }


OWNER = _raw("bank", "llm-bank", "2026-01-01T00:00:00Z")
LATER = _raw("thief", "llm-other", "2026-01-02T00:00:00Z")


def _owner_of(*raw: dict[str, Any], group: str = "bank-h200") -> str:
    return gpu_group_owners(gpu_group_claims(raw))[group].tenant


@pytest.mark.parametrize(
    ("tenants", "owner"),
    [
        pytest.param([OWNER, LATER], "llm-bank/bank", id="oldest-wins"),
        pytest.param([LATER, OWNER], "llm-bank/bank", id="whatever-the-list-order"),
        pytest.param(
            [_raw("b", "ns-b", "2026-01-01T00:00:00Z"), _raw("a", "ns-z", "2026-01-01T00:00:00Z")],
            "ns-b/b",
            id="same-second-namespace-first",
        ),
        pytest.param(
            [_raw("b", "ns", "2026-01-01T00:00:00Z"), _raw("a", "ns", "2026-01-01T00:00:00Z")],
            "ns/a",
            id="same-second-same-namespace-name-next",
        ),
        pytest.param(
            [
                {**OWNER, "metadata": {**OWNER["metadata"], "deletionTimestamp": "2026-02-01T00:00:00Z"}},
                LATER,
            ],
            "llm-other/thief",
            id="a-deleting-owner-releases-the-group",
        ),
    ],
)
def test_the_oldest_claimant_owns_the_group(tenants: list[dict[str, Any]], owner: str) -> None:
    assert _owner_of(*tenants) == owner


def test_only_dedicated_tenants_claim_and_each_group_has_its_own_owner() -> None:
    shared = _raw("startup", "llm", "2025-01-01T00:00:00Z", group=None)
    other = _raw("hospital", "llm-h", "2026-03-01T00:00:00Z", group="hospital-a100")
    claims = gpu_group_claims([shared, OWNER, LATER, other])
    assert {c.name for c in claims} == {"bank", "thief", "hospital"}
    owners = gpu_group_owners(claims)
    assert {group: claim.tenant for group, claim in owners.items()} == {
        "bank-h200": "llm-bank/bank",
        "hospital-a100": "llm-h/hospital",
    }


def test_a_tenant_that_does_not_parse_still_claims_its_group() -> None:
    """The API server accepted it: once fixed, its pods must not find another tenant on its GPUs."""
    broken = _raw("bank", "llm-bank", "2026-01-01T00:00:00Z")
    broken["spec"]["burstLimit"] = "not a share"
    assert _owner_of(broken, LATER) == "llm-bank/bank"


def test_duplicates_of_one_tenant_count_once() -> None:
    claims = [*gpu_group_claims([OWNER]), *gpu_group_claims([OWNER])]
    assert gpu_group_owners(claims) == {"bank-h200": GroupClaim(*_claim_fields(OWNER))}


def _claim_fields(raw: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = raw["metadata"]
    return meta["creationTimestamp"], meta["namespace"], meta["name"], raw["spec"]["dedicated"]["gpuGroup"]


def test_a_later_claimant_is_refused_naming_the_owner_and_the_owner_is_not() -> None:
    owners = gpu_group_owners(gpu_group_claims([OWNER, LATER]))
    refused = refused_claimants([Tenant.model_validate(LATER), Tenant.model_validate(OWNER)], owners)
    assert set(refused) == {"thief"}
    message = refused["thief"]
    assert "llm-bank/bank" in message and "'bank-h200'" in message
    assert "Nothing was applied" in message


def test_a_same_name_tenant_in_another_namespace_is_not_the_owner() -> None:
    twin = _raw("bank", "llm-other", "2026-01-02T00:00:00Z")
    owners = gpu_group_owners(gpu_group_claims([OWNER, twin]))
    assert set(refused_claimants([Tenant.model_validate(twin)], owners)) == {"bank"}


def test_non_dedicated_tenants_are_never_refused() -> None:
    shared = Tenant.model_validate(_raw("startup", "llm", "2027-01-01T00:00:00Z", group=None))
    assert refused_claimants([shared], gpu_group_owners(gpu_group_claims([OWNER]))) == {}


@pytest.mark.parametrize(
    ("tolerations", "expected"),
    [
        pytest.param([{"operator": "Exists"}], True, id="wildcard"),
        pytest.param(
            [{"key": "", "operator": "Exists", "effect": "NoSchedule"}], True, id="wildcard-one-effect"
        ),
        pytest.param([{"key": "kvfleet.io/gpu-group", "operator": "Exists"}], True, id="every-group"),
        pytest.param(
            [{"key": "kvfleet.io/gpu-group", "operator": "Equal", "value": "g"}], True, id="one-group"
        ),
        pytest.param([{"key": "nvidia.com/gpu", "operator": "Exists"}], False, id="another-key"),
        pytest.param(
            [{"key": "", "operator": "Equal", "value": ""}], False, id="empty-equal-matches-nothing"
        ),
        pytest.param([], False, id="none"),
    ],
)
def test_which_tolerations_could_admit_a_groups_taint(
    tolerations: list[dict[str, Any]], expected: bool
) -> None:
    assert tolerates_gpu_groups(tolerations) is expected
