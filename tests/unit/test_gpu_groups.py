"""Who owns a dedicated GPU group (build/gpu_groups.py): the oldest claimant in any watched namespace,
stable until it is deleted; every other claimant is refused with a message naming the owner."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from devcluster import find_binary

from conftest import missing_component
from kvfleet_operator.api import Tenant
from kvfleet_operator.api.common import GPU_GROUP_LABEL
from kvfleet_operator.build.common import LABEL_COMPONENT, LABEL_MANAGED_BY, LABEL_POOL, object_labels
from kvfleet_operator.build.gpu_groups import (
    GroupClaim,
    gpu_group_claims,
    gpu_group_owners,
    refused_claimants,
    tolerates_gpu_groups,
)
from kvfleet_operator.build.tenant_table import dedicated_pool_name

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvfleet"


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


# --- the chart's admission policies (their behaviour is tested on the real API server in
# tests/security/test_dedicated_gpu_groups.py; here: they name what the operator builds) -----------------
def _render_policies(*args: str) -> list[dict[str, Any]]:
    helm = find_binary("helm")
    if helm is None:
        missing_component("helm", "hack/build-cluster.sh")
    done = subprocess.run(
        [str(helm), "template", "kvfleet", str(CHART), "-n", "kvfleet-system", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    return [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]


def test_the_policies_name_the_labels_and_identities_the_operator_uses() -> None:
    docs = _render_policies()
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    assert set(policies) == {"kvfleet-dedicated-gpu-pods", "kvfleet-dedicated-gpu-workloads"}
    text = "\n".join(
        e["expression"]
        for p in policies.values()
        for e in (*p["spec"]["variables"], *p["spec"]["validations"])
    )
    engine_labels = object_labels("m", "engine", dedicated_pool_name("bank"))
    for key in (LABEL_MANAGED_BY, LABEL_COMPONENT, LABEL_POOL):
        assert f"'{key}'" in text, key
    assert f"'{engine_labels[LABEL_MANAGED_BY]}'" in text and f"'{engine_labels[LABEL_COMPONENT]}'" in text
    assert f"startsWith('{dedicated_pool_name('')}')" in text
    assert text.count(f"'{GPU_GROUP_LABEL}'") >= 8  # tolerations, node selector, affinity, exclusion
    assert "system:serviceaccount:kvfleet-system:kvfleet'" in text  # the operator's ServiceAccount
    assert "system:serviceaccount:kube-system:statefulset-controller" in text
    for policy in policies.values():
        assert policy["spec"]["failurePolicy"] == "Fail"
        assert {v["reason"] for v in policy["spec"]["validations"]} == {"Forbidden"}


def test_bindings_deny_everywhere_but_the_exempt_namespaces_and_the_policies_can_be_turned_off() -> None:
    bindings = [d for d in _render_policies() if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert len(bindings) == 2
    for binding in bindings:
        assert binding["spec"]["validationActions"] == ["Deny"]
        assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"] == [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}
        ]
    none_exempt = _render_policies("--set-json", "dedicatedGpuGroups.exemptNamespaces=[]")
    assert all("matchResources" not in d["spec"] for d in none_exempt if "Binding" in d["kind"])
    assert _render_policies("--set", "dedicatedGpuGroups.admissionPolicy=false") == []
