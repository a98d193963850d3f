"""API-tier smoke tests: only a real kube-apiserver (with etcd) can make these pass.

The CRDs in crds/ are applied exactly as generated and must become Established; the API server must
reject invalid manifests with the CRD's own CEL messages; RBAC, PodSecurity admission and service-account
tokens must behave as in a real cluster.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_helpers import (
    apply_crds,
    cel_messages,
    crd_files,
    create_namespace,
    delete_namespace,
    pinned_kubernetes_version,
    plural_path,
    unique_name,
    wait_for,
)
from devcluster import ControlPlane

# The invalid-manifest table (tests/invalid_manifests.py; tests/unit replays it through pydantic).
from invalid_manifests import (
    INVALID_MANIFESTS,
    InvalidManifestCase,
    RuleKind,
    build_base_manifest,
    build_invalid_manifest,
    build_old_manifest,
)

#: A hand-written invalid Tenant: dedicated isolation without its GPU group (a CEL rule on spec).
DEDICATED_WITHOUT_GROUP: dict[str, Any] = {
    "apiVersion": "kvfleet.io/v1alpha1",
    "kind": "Tenant",
    "metadata": {"name": "dedicated-without-group"},
    "spec": {
        "modelDeploymentRef": {"name": "base"},
        "tier": "premium",
        "isolation": "dedicated",
        "kvQuota": {"hbm": "20%", "cpu": "16Gi", "nvme": "100Gi"},
        "burstLimit": "50%",
    },
}


@pytest.fixture(scope="module")
def crds(api_cluster: ControlPlane) -> list[str]:
    if len(crd_files()) == 0:
        pytest.fail("crds/ holds no YAML files: generate them with `make generate`", pytrace=False)
    return apply_crds(api_cluster)


@pytest.fixture(scope="module")
def cr_namespace(api_cluster: ControlPlane, crds: list[str]) -> Iterator[str]:
    name = create_namespace(api_cluster, "crd-smoke")
    yield name
    delete_namespace(api_cluster, name)


def test_server_reports_the_pinned_kubernetes_version(api_cluster: ControlPlane) -> None:
    status, body = api_cluster.request("GET", "/version")
    assert status == 200
    assert body["gitVersion"] == pinned_kubernetes_version()
    assert body["gitTreeState"] == "clean"


def test_crds_are_accepted_unchanged_and_established(api_cluster: ControlPlane, crds: list[str]) -> None:
    assert len(crds) >= 2, f"expected at least 2 CRDs in crds/, applied {crds}"
    # The API server serves every version the files declare (pruning nothing of the schema's intent).
    status, body = api_cluster.request("GET", "/apis/kvfleet.io/v1alpha1")
    assert status == 200, body
    kinds = {r["kind"] for r in body["resources"] if "/" not in r["name"]}
    assert {"Tenant", "ModelDeployment"} <= kinds


def test_valid_base_manifests_are_accepted(api_cluster: ControlPlane, cr_namespace: str) -> None:
    assert len(INVALID_MANIFESTS) >= 40
    for kind in ("ModelDeployment", "Tenant"):
        manifest = build_base_manifest(kind)
        manifest["metadata"] = {"name": unique_name("valid"), "namespace": cr_namespace}
        status, body = api_cluster.request(
            "POST", plural_path(kind, cr_namespace) + "?fieldValidation=Strict", manifest
        )
        assert status == 201, f"valid {kind} rejected: {body}"


@pytest.mark.parametrize("size", ["512Gi", "0.5Gi", 1073741824])
def test_an_enabled_shared_tier_with_a_size_is_accepted(
    api_cluster: ControlPlane, cr_namespace: str, size: object
) -> None:
    """The shared tier's CEL rule reads an int-or-string size: both forms pass when not zero."""
    manifest = build_base_manifest("ModelDeployment")
    manifest["metadata"] = {"name": unique_name("shared-tier"), "namespace": cr_namespace}
    manifest["spec"].setdefault("kvCache", {})["shared"] = {"enabled": True, "size": size}
    status, body = api_cluster.request(
        "POST", plural_path("ModelDeployment", cr_namespace) + "?fieldValidation=Strict", manifest
    )
    assert status == 201, f"shared tier of {size!r} rejected: {body}"


def test_invalid_tenant_is_rejected_with_the_cel_message(
    api_cluster: ControlPlane, cr_namespace: str
) -> None:
    manifest = json.loads(json.dumps(DEDICATED_WITHOUT_GROUP))
    manifest["metadata"]["namespace"] = cr_namespace
    status, body = api_cluster.request("POST", plural_path("Tenant", cr_namespace), manifest)
    assert status == 422, body
    assert body["reason"] == "Invalid"
    assert (
        "spec.dedicated (gpuGroup, replicas) is required when spec.isolation is dedicated" in body["message"]
    )


def _case_id(case: Any) -> str:
    return str(case.id)


@pytest.mark.parametrize("case", INVALID_MANIFESTS, ids=_case_id)
def test_invalid_manifest_table_is_rejected_by_the_api_server(
    api_cluster: ControlPlane, cr_namespace: str, case: InvalidManifestCase
) -> None:
    path = plural_path(case.kind, cr_namespace)
    query = "?fieldValidation=Strict" if case.strict_only else ""
    name = case.id[:50]
    manifest = build_invalid_manifest(case)
    manifest["metadata"] = {"name": name, "namespace": cr_namespace}
    old = build_old_manifest(case)
    if old is None:
        status, body = api_cluster.request("POST", path + query, manifest)
    else:
        old["metadata"] = {"name": name, "namespace": cr_namespace}
        created_status, created = api_cluster.request("POST", path, old)
        assert created_status == 201, f"the valid old version was rejected: {created}"
        manifest["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"]
        status, body = api_cluster.request("PUT", f"{path}/{name}{query}", manifest)
    # Strict field validation answers 400 BadRequest ("unknown field"); every other rejection is 422.
    expected = 400 if case.strict_only else 422
    assert status == expected, f"{case.id}: expected {expected}, got {status}: {body}"
    message = body["message"]
    assert case.field in message, f"{case.id}: {case.field} not named in: {message}"
    if case.rule == RuleKind.CEL:
        assert any(m in message for m in cel_messages()), f"{case.id}: no CEL message in: {message}"


def test_pod_security_admission_enforces_namespace_labels(api_cluster: ControlPlane) -> None:
    ns = create_namespace(api_cluster, "psa", labels={"pod-security.kubernetes.io/enforce": "restricted"})
    try:
        # Only the controller manager creates "default" service accounts; the api tier has none.
        status, body = api_cluster.request(
            "POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "default"}}
        )
        assert status in (201, 409), body
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "privileged"},
            "spec": {
                "automountServiceAccountToken": False,
                "containers": [
                    {
                        "name": "c",
                        "image": "registry.k8s.io/pause:3.10",
                        "securityContext": {"privileged": True},
                    }
                ],
            },
        }
        status, body = api_cluster.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
        assert status == 403, body
        assert "violates PodSecurity" in body["message"]
    finally:
        delete_namespace(api_cluster, ns)


def test_rbac_denies_a_service_account_until_a_role_binds_it(api_cluster: ControlPlane) -> None:
    ns = create_namespace(api_cluster, "rbac")
    try:
        sa = "reader"
        assert (
            api_cluster.request(
                "POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": sa}}
            )[0]
            == 201
        )
        status, token = api_cluster.request(
            "POST",
            f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
            {"spec": {"expirationSeconds": 600}},
        )
        assert status == 201, token
        bearer = token["status"]["token"]

        def list_configmaps() -> int:
            ctx = ssl.create_default_context(cafile=str(api_cluster.pki.ca_cert))
            req = urllib.request.Request(
                f"{api_cluster.server}/api/v1/namespaces/{ns}/configmaps",
                headers={"Authorization": f"Bearer {bearer}"},
            )
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
                    return int(resp.status)
            except urllib.error.HTTPError as err:
                return err.code

        assert list_configmaps() == 403
        role = {
            "metadata": {"name": "cm-reader"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
        }
        binding = {
            "metadata": {"name": "cm-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
        }
        rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}"
        assert api_cluster.request("POST", f"{rbac}/roles", role)[0] == 201
        assert api_cluster.request("POST", f"{rbac}/rolebindings", binding)[0] == 201
        wait_for(lambda: list_configmaps() == 200, timeout=20, what="RBAC to allow the bound service account")
    finally:
        delete_namespace(api_cluster, ns)
