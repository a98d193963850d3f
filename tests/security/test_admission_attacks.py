"""Attacks on what a tenant was admitted: another tenant's quota change must not take it away.

Against the operator's reconcile and the real API server, which stores the only memory admission has
(``status.admittedQuota``): the property over random histories is tests/unit/test_admission_properties.py.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
from devcluster import BUILD_COMMAND, ControlPlane, missing_binaries

from components import missing_component
from kvfleet_runtime.config import hash_api_key
from operator_support import (
    API,
    condition,
    converge,
    create,
    events_of,
    key_file,
    load_example,
    secret_value,
    tenant,
    tenant_table,
    tiny_namespace,
)


def _tenant(namespace: str, name: str, hbm: str) -> dict[str, object]:
    doc = load_example("local/tenant-basic-a.yaml", namespace)
    doc["metadata"]["name"] = name
    doc["spec"].update(isolation="salted", kvQuota={"hbm": hbm}, burstLimit="80%")
    return doc


@pytest.fixture
def namespace(api_cluster: ControlPlane) -> Iterator[str]:
    """``old`` (created first, 30%) and ``young`` (50%), both admitted and serving."""
    for ns in tiny_namespace(api_cluster, "admission"):
        create(api_cluster, _tenant(ns, "old", "30%"))
        converge(api_cluster, ns, "tiny")
        create(api_cluster, _tenant(ns, "young", "50%"))
        converge(api_cluster, ns, "tiny")
        yield ns


def _set_hbm(plane: ControlPlane, namespace: str, name: str, hbm: str) -> None:
    status, body = plane.request(
        "PATCH",
        f"{API}/namespaces/{namespace}/tenants/{name}",
        {"spec": {"kvQuota": {"hbm": hbm}}},
        content_type="application/merge-patch+json",
    )
    assert status == 200, body


def test_an_older_tenants_raise_cannot_evict_a_younger_serving_tenant(
    api_cluster: ControlPlane, namespace: str
) -> None:
    """Threat: an older tenant raises its quota and, because admission was recomputed first come, first
    served on every reconcile, a younger tenant that is serving loses its admission and its key starts
    getting 401. Admission is sticky: the raise is refused on the tenant that asked, which keeps serving
    at its admitted quota; it is granted once room frees."""
    plane = api_cluster
    young_key = secret_value(plane, namespace, "young-api-key")
    assert young_key is not None
    before = tenant_table(plane, namespace, "tiny").tenants

    _set_hbm(plane, namespace, "old", "60%")
    converge(plane, namespace, "tiny")

    table = tenant_table(plane, namespace, "tiny").tenants
    assert table["young"].quota == before["young"].quota  # untouched
    assert table["old"].quota == before["old"].quota  # still serving at 30%
    assert key_file(plane, namespace, "tiny").key_hashes["young"] == [hash_api_key(young_key)]
    old = tenant(plane, namespace, "old")
    assert old["status"]["requestedQuota"]["hbm"] == "60%"
    assert old["status"]["admittedQuota"]["hbm"] == "30%"
    degraded = condition(old, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "QuotaChangeRefused")
    assert "HBM guarantees would total" in degraded["message"]
    assert ("Warning", "QuotaChangeRefused") in events_of(plane, namespace, "old")
    assert condition(tenant(plane, namespace, "young"), "Degraded")["status"] == "False"

    # The room frees: the raise that was refused is granted, level-triggered, with no new edit.
    plane.request("DELETE", f"{API}/namespaces/{namespace}/tenants/young")
    converge(plane, namespace, "tiny")
    old = tenant(plane, namespace, "old")
    assert old["status"]["admittedQuota"]["hbm"] == "60%"
    assert condition(old, "Degraded")["status"] == "False"
    assert (
        tenant_table(plane, namespace, "tiny").tenants["old"].quota.hbm_blocks
        > before["old"].quota.hbm_blocks
    )


def test_kubectl_get_shows_requested_and_admitted_side_by_side(
    api_cluster: ControlPlane, namespace: str
) -> None:
    """What an operator on call sees: the HBM quota asked for next to the one admitted."""
    if missing_binaries(("kubectl",)):
        missing_component("kubectl", BUILD_COMMAND)
    _set_hbm(api_cluster, namespace, "old", "60%")
    converge(api_cluster, namespace, "tiny")
    shown = subprocess.run(
        ["kubectl", "get", "tn", "-n", namespace, "--no-headers"],
        env=api_cluster.env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    rows = {line.split()[0]: line.split() for line in shown.splitlines()}
    # NAME MODEL TIER ISOLATION HBM-QUOTA ADMITTED-HBM READY AGE
    assert rows["old"][4:6] == ["60%", "30%"]
    assert rows["young"][4:6] == ["50%", "50%"]
