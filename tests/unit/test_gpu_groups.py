"""Who owns a dedicated GPU group (build/gpu_groups.py): whom the platform bound it to
(``dedicatedGpuGroups.owners``), the oldest claimant within that binding; every other claimant is refused
with a message naming the binding or the chart value to set. A group nobody bound keeps only a pool that
already runs (an upgrade)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_operator.api import Tenant, reasons
from kvfleet_operator.build.gpu_groups import (
    GroupBinding,
    GroupClaim,
    decide_gpu_group_claims,
    gpu_group_claims,
    gpu_group_owners,
    parse_gpu_group_owners,
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


BANK_ONLY = {"bank-h200": GroupBinding("llm-bank", "bank")}


def _decide(
    *raw: dict[str, Any],
    bindings: dict[str, GroupBinding] | None = None,
    running: tuple[str, ...] = (),
    claims: tuple[dict[str, Any], ...] = (),
) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    decided = decide_gpu_group_claims(
        [Tenant.model_validate(r) for r in raw],
        gpu_group_claims([*raw, *claims]),
        BANK_ONLY if bindings is None else bindings,
        running,
    )
    return decided.refused, decided.unbound


def test_the_bound_tenant_gets_its_group_even_when_a_squatter_claimed_it_first() -> None:
    """The squat: a team names the bank's group before the bank does. The binding decides, not the
    order: the squatter is refused naming the binding and the chart value, the bank is not."""
    squatter = _raw("thief", "llm-other", "2025-01-01T00:00:00Z")
    refused, unbound = _decide(OWNER, squatter)
    assert set(refused) == {"thief"} and unbound == {}
    reason, message = refused["thief"]
    assert reason == reasons.GPU_GROUP_IN_USE
    assert "Tenant llm-bank/bank" in message and "'bank-h200'" in message
    assert "dedicatedGpuGroups.owners" in message and "Nothing was applied" in message


def test_a_same_name_tenant_in_another_namespace_is_not_the_owner() -> None:
    twin = _raw("bank", "llm-other", "2025-01-02T00:00:00Z")
    assert set(_decide(twin, claims=(OWNER,))[0]) == {"bank"}


def test_a_namespace_binding_admits_its_tenants_and_the_oldest_of_them_serves() -> None:
    first = _raw("bank", "llm-bank", "2026-01-01T00:00:00Z")
    second = _raw("bank-eu", "llm-bank", "2026-01-03T00:00:00Z")
    elsewhere = _raw("thief", "llm-other", "2025-01-01T00:00:00Z")
    refused, _ = _decide(first, second, bindings={"bank-h200": GroupBinding("llm-bank")}, claims=(elsewhere,))
    assert set(refused) == {"bank-eu"}
    assert refused["bank-eu"][0] == reasons.GPU_GROUP_IN_USE and "llm-bank/bank " in refused["bank-eu"][1]


def test_an_unbound_group_builds_nothing_and_names_the_value_to_set() -> None:
    refused, unbound = _decide(OWNER, bindings={})
    assert unbound == {}
    reason, message = refused["bank"]
    assert reason == reasons.GPU_GROUP_NOT_BOUND
    assert "dedicatedGpuGroups.owners.bank-h200=llm-bank/bank" in message
    assert "Nothing was applied" in message


def test_after_an_upgrade_the_running_owner_of_an_unbound_group_keeps_its_pool() -> None:
    """Groups were not bound before the upgrade: the tenant that owned the group by the old rule (the
    oldest claimant) and whose pool runs keeps it, with a warning naming the entry to add; a younger
    claimant, or an owner whose pool does not run, gets nothing."""
    refused, unbound = _decide(OWNER, LATER, bindings={}, running=("bank", "thief"))
    assert set(unbound) == {"bank"} and set(refused) == {"thief"}
    assert "dedicatedGpuGroups.owners.bank-h200=llm-bank/bank" in unbound["bank"]
    assert "keeps running" in unbound["bank"]
    assert refused["thief"][0] == reasons.GPU_GROUP_NOT_BOUND


def test_non_dedicated_tenants_are_never_refused() -> None:
    shared = _raw("startup", "llm", "2027-01-01T00:00:00Z", group=None)
    assert _decide(shared, bindings={}) == ({}, {})


def test_the_bindings_parse_from_the_chart_value() -> None:
    assert parse_gpu_group_owners(None) == {}
    assert parse_gpu_group_owners("{}") == {}
    assert parse_gpu_group_owners('{"bank-h200": "llm/bank", "lab-a100": "research"}') == {
        "bank-h200": GroupBinding("llm", "bank"),
        "lab-a100": GroupBinding("research"),
    }


@pytest.mark.parametrize(
    "text",
    [
        '["bank-h200"]',
        '{"bank-h200": "LLM/bank"}',
        '{"bank-h200": "llm/"}',
        '{"bank-h200": "/bank"}',
        '{"Bank": "llm"}',
        '{"bank-h200": 3}',
        '{"bank-h200": "llm/bank/x"}',
    ],
)
def test_a_malformed_binding_stops_the_operator(text: str) -> None:
    with pytest.raises(ValueError, match=r"dedicatedGpuGroups\.owners"):
        parse_gpu_group_owners(text)


def test_the_binding_limits_who_can_own_even_by_age() -> None:
    """gpu_group_owners with bindings: an older claimant outside the binding never becomes the owner."""
    squatter = _raw("thief", "llm-other", "2025-01-01T00:00:00Z")
    owners = gpu_group_owners(gpu_group_claims([squatter, OWNER]), BANK_ONLY)
    assert owners["bank-h200"].tenant == "llm-bank/bank"
    assert gpu_group_owners(gpu_group_claims([squatter]), BANK_ONLY) == {}


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
