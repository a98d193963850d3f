"""Drift repair against the real API server: every field the operator sets comes back when removed.

Threat: someone with write access to the namespace (a compromised CI job, a hurried human) deletes a
hardening field from a live engine or gateway template (``automountServiceAccountToken: false``,
``allowPrivilegeEscalation: false``, ...). A plan that read a missing field as ``false`` would never
restore it, and the next pod would run with a service-account token or with privilege escalation allowed.
Each field is removed with a JSON patch (another field manager, as ``kubectl edit`` would), and one
reconcile must bring it back; a converged object must then cost no write.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
from devcluster import ControlPlane

from kvfleet_operator.build.common import restricted_container_security, restricted_pod_security
from operator_support import (
    converge,
    create,
    get,
    key_secret,
    load_example,
    reconcile,
    scratch_namespace,
    strong_key,
)

POD = "/spec/template/spec"
CONTAINER = f"{POD}/containers/0/securityContext"
#: (JSON pointer of the field, what the operator sets there), for the pod and its first container.
SECURITY_FIELDS = [
    (f"{POD}/automountServiceAccountToken", False),
    (f"{POD}/enableServiceLinks", False),
    (f"{POD}/securityContext/runAsNonRoot", restricted_pod_security()["runAsNonRoot"]),
    (f"{POD}/securityContext/seccompProfile", restricted_pod_security()["seccompProfile"]),
    *[(f"{CONTAINER}/{field}", value) for field, value in restricted_container_security().items()],
    (f"{CONTAINER}/capabilities/drop", ["ALL"]),
]
WORKLOADS = [
    ("apps/v1", "deployments", "qwen72b-gateway"),
    ("apps/v1", "statefulsets", "qwen72b-engine"),
    ("apps/v1", "statefulsets", "qwen72b-dedicated-bank-engine"),
]


@pytest.fixture(scope="module")
def namespace(api_cluster: ControlPlane) -> Iterator[str]:
    """The GPU examples (shared pool, a dedicated bank with tolerations, NVMe claim templates), converged."""
    with scratch_namespace(api_cluster, "drift", crds=True) as ns:
        bank_secret = key_secret(ns, "bank-api-key", strong_key(), tenant="bank")
        create(api_cluster, bank_secret)
        create(api_cluster, load_example("modeldeployment-qwen72b.yaml", ns))
        for name in ("tenant-bank.yaml", "tenant-saas.yaml", "tenant-startup-a.yaml"):
            doc = load_example(name, ns)
            if (
                "dedicated" in doc["spec"]
            ):  # a group of its own: a GPU group belongs to one tenant cluster-wide
                doc["spec"]["dedicated"]["gpuGroup"] = f"group-{ns}"
            create(api_cluster, doc)
        converge(api_cluster, ns, "qwen72b")
        yield ns


def _at(obj: Any, pointer: str) -> Any:
    for part in pointer.strip("/").split("/"):
        obj = obj[int(part)] if isinstance(obj, list) else obj.get(part, KeyError)
        if obj is KeyError:
            return KeyError
    return obj


def test_a_converged_namespace_costs_no_write(api_cluster: ControlPlane, namespace: str) -> None:
    """Only the zero values the server drops itself may be missing (plan.SERVER_OMITS_ZERO): were one
    missing from that list, every reconcile would apply the object again.

    Applies are what such a gap costs, so they are what is counted. When an earlier test extended the
    session's plane to the full tier, kwok's pods come and go and the controllers write replica counts, so a
    round may rightly write status (the ModelDeployment's and its tenants', with their Events); the
    namespace must still reach a round with no write at all."""
    for _ in range(3):
        result, _writes = reconcile(api_cluster, namespace, "qwen72b")
        assert (result.applied, result.deleted) == ([], [])
    converge(api_cluster, namespace, "qwen72b")


@pytest.mark.parametrize(
    ("pointer", "value"), SECURITY_FIELDS, ids=[p.split("spec/")[-1] for p, _ in SECURITY_FIELDS]
)
@pytest.mark.parametrize(("api", "plural", "name"), WORKLOADS, ids=[w[2] for w in WORKLOADS])
def test_a_removed_security_field_comes_back_after_one_reconcile(
    api_cluster: ControlPlane, namespace: str, api: str, plural: str, name: str, pointer: str, value: Any
) -> None:
    plane = api_cluster
    path = f"/apis/{api}/namespaces/{namespace}/{plural}/{name}"
    assert _at(get(plane, path), pointer) == value
    status, body = plane.request(
        "PATCH", path, [{"op": "remove", "path": pointer}], content_type="application/json-patch+json"
    )
    assert status == 200, body
    assert _at(get(plane, path), pointer) is KeyError  # the server kept the removal

    result, _ = reconcile(plane, namespace, "qwen72b")
    kind = {"deployments": "Deployment", "statefulsets": "StatefulSet"}[plural]
    assert result.applied == [f"apply {kind} {namespace}/{name}"]  # exactly the drifted object
    assert _at(get(plane, path), pointer) == value
    converge(plane, namespace, "qwen72b")  # and then nothing more to write


def test_a_forged_key_file_is_restored(api_cluster: ControlPlane, namespace: str) -> None:
    """Threat: someone rewrites the gateway's key file (to add a key of their own, or drop a tenant's).
    The keys Secret is restored byte for byte by the next reconcile."""
    path = f"/api/v1/namespaces/{namespace}/secrets/qwen72b-keys"
    before = get(api_cluster, path)["data"]["keys.json"]
    forged = base64.b64encode(b'{"schema_version": 1}').decode()
    status, body = api_cluster.request(
        "PATCH", path, {"data": {"keys.json": forged}}, content_type="application/merge-patch+json"
    )
    assert status == 200, body
    result, _ = reconcile(api_cluster, namespace, "qwen72b")
    assert result.applied == [f"apply Secret {namespace}/qwen72b-keys"]
    assert get(api_cluster, path)["data"]["keys.json"] == before


@pytest.fixture(scope="module")
def picker_namespace(api_cluster: ControlPlane) -> Iterator[str]:
    """The CPU example with Envoy as its data plane, an InferencePool asked for (withheld: the default
    configuration manages none) and TLS on the picker's port: the Endpoint Picker's and Envoy's pods,
    converged."""
    with scratch_namespace(api_cluster, "drift-epp", crds=True) as ns:
        md = load_example("local/modeldeployment-tiny.yaml", ns)
        md["spec"].setdefault("gateway", {}).update(
            dataPlane="envoy",
            inferencePool={"gatewayPods": {"matchLabels": {"app": "edge"}}},
            endpointPicker={"tlsSecretName": "tiny-epp-tls"},
        )
        create(api_cluster, md)
        converge(api_cluster, ns, "tiny")
        yield ns


@pytest.mark.parametrize(
    ("pointer", "value"), SECURITY_FIELDS, ids=[p.split("spec/")[-1] for p, _ in SECURITY_FIELDS]
)
@pytest.mark.parametrize("name", ["tiny-epp", "tiny-gateway"])
def test_the_pickers_and_envoys_security_fields_come_back_after_one_reconcile(
    api_cluster: ControlPlane, picker_namespace: str, name: str, pointer: str, value: Any
) -> None:
    """The same threat on the second front door: the Endpoint Picker holds the key hashes and the salt
    key; Envoy's pods hold the picker's CA."""
    plane, namespace = api_cluster, picker_namespace
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"
    assert _at(get(plane, path), pointer) == value
    status, body = plane.request(
        "PATCH", path, [{"op": "remove", "path": pointer}], content_type="application/json-patch+json"
    )
    assert status == 200, body
    result, _ = reconcile(plane, namespace, "tiny")
    assert result.applied == [f"apply Deployment {namespace}/{name}"]
    assert _at(get(plane, path), pointer) == value
    converge(plane, namespace, "tiny")
