"""Objects adopted or collided by name, on the real API server (issue 23, hole 1).

Threat: the operator names a ModelDeployment's children from its name alone (``<md>-keys``,
``<md>-gateway``, ``<md>-engine``, ``<md>-dedicated-<tenant>-engine``) and applies them with its own
rights. Someone who may create a ModelDeployment or a Tenant in a namespace, but not write its Secrets,
Services or NetworkPolicies, names one so that a child's name is an object that is not the operator's
(a team's Secret ``stripe-keys``) or another ModelDeployment's (the bank's dedicated pool
``qwen72b-dedicated-bank-engine``). Were the operator to apply over it, the Secret would get kvfleet's
``keys.json``, labels and owner reference (deleting the ModelDeployment would delete it), and the bank's
NetworkPolicy and Service would get the attacker's selector: the bank's dedicated engines reachable from
the attacker's gateway, the bank's gateway without replicas.

Defences under test: the operator writes only objects their owner already controls (a controller owner
reference with its uid: the ModelDeployment, or the Tenant of a dedicated pool) or that do not exist yet
(``reconcile/ownership.py``, step ``claim_names``). A name in use by anything else is reported
(``NameInUse``, naming the object and who owns it) and nothing is written: for the ModelDeployment's own
objects the whole reconcile stops; for a dedicated tenant's pool only that tenant is left out. The objects
in the way keep their resourceVersion: not a byte changed. And the chart's admission policy
(``templates/model-deployment-names.yaml``) refuses creating a ModelDeployment whose name could collide
with another's pools (``-dedicated-`` inside, or ``-dedicated`` at the end), the only way two
ModelDeployments' children can share a name; the ModelDeployments the earlier tests create stand for ones
created before the policy (an upgrade): they keep working, with ``NameInUse`` where they collide.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import run_tool, wait_for
from devcluster import ControlPlane

from kvfleet_operator.api import reasons
from kvfleet_operator.build.common import SHARED_POOL, engine_name
from kvfleet_operator.build.tenant_table import dedicated_pool_name
from operator_support import (
    API,
    condition,
    converge,
    create,
    get,
    key_secret,
    load_example,
    model_deployment,
    reconcile,
    scratch_namespace,
    strong_key,
    tenant,
)

BANK_POOL = "qwen72b-dedicated-bank-engine"
#: The four objects of the bank's dedicated pool, by API path under the namespace.
BANK_POOL_OBJECTS = {
    "StatefulSet": f"/apis/apps/v1/namespaces/{{ns}}/statefulsets/{BANK_POOL}",
    "Service": f"/api/v1/namespaces/{{ns}}/services/{BANK_POOL}",
    "PodDisruptionBudget": f"/apis/policy/v1/namespaces/{{ns}}/poddisruptionbudgets/{BANK_POOL}",
    "NetworkPolicy": f"/apis/networking.k8s.io/v1/namespaces/{{ns}}/networkpolicies/{BANK_POOL}",
}


def _model_deployment(namespace: str, name: str) -> dict[str, Any]:
    doc = load_example("modeldeployment-qwen72b.yaml", namespace)
    doc["metadata"]["name"] = name
    return doc


def _dedicated_tenant(namespace: str, name: str, md: str, group: str) -> dict[str, Any]:
    doc = load_example("tenant-bank.yaml", namespace)
    doc["metadata"]["name"] = name
    doc["spec"]["modelDeploymentRef"]["name"] = md
    doc["spec"]["dedicated"]["gpuGroup"] = group
    doc["spec"].pop("apiKeySecretRef")  # generated once admitted
    return doc


def _post(plane: ControlPlane, path: str, doc: dict[str, Any]) -> dict[str, Any]:
    status, body = plane.request("POST", path, doc)
    assert status == 201, body
    created: dict[str, Any] = body
    return created


def _exists(plane: ControlPlane, path: str) -> bool:
    return int(plane.request("GET", path)[0]) == 200


def _versions(plane: ControlPlane, namespace: str) -> dict[str, str]:
    """resourceVersion of each of the bank pool's objects: any write changes it."""
    return {
        kind: str(get(plane, path.format(ns=namespace))["metadata"]["resourceVersion"])
        for kind, path in BANK_POOL_OBJECTS.items()
    }


@pytest.fixture(scope="module")
def bank(api_cluster: ControlPlane) -> Iterator[str]:
    """The GPU example ModelDeployment ``qwen72b`` with its dedicated tenant ``bank`` (a group of its own),
    converged: the four objects of the bank's pool exist and belong to ``qwen72b``."""
    with scratch_namespace(api_cluster, "names", crds=True) as ns:
        create(api_cluster, key_secret(ns, "bank-api-key", strong_key(), tenant="bank"))
        create(api_cluster, load_example("modeldeployment-qwen72b.yaml", ns))
        doc = load_example("tenant-bank.yaml", ns)
        doc["spec"]["dedicated"]["gpuGroup"] = f"group-{ns}"
        create(api_cluster, doc)
        converge(api_cluster, ns, "qwen72b")
        for path in BANK_POOL_OBJECTS.values():
            assert _exists(api_cluster, path.format(ns=ns)), path
        yield ns


def test_a_model_deployment_named_after_a_teams_secret_does_not_take_it_over(
    api_cluster: ControlPlane, bank: str
) -> None:
    """Attack: a team's Secret ``stripe-keys`` and Service ``stripe-gateway`` exist (not kvfleet's). A user
    who may create ModelDeployments creates one named ``stripe``. Its reconcile must not write either:
    no ``keys.json``, no kvfleet labels, no owner reference on the Secret (deleting the ModelDeployment
    would delete it), the Service keeps its selector; the ModelDeployment gets ``NameInUse`` naming the
    object, and nothing else of it is written (no half-applied state)."""
    plane, ns = api_cluster, bank
    team_secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "stripe-keys", "namespace": ns, "labels": {"team": "payments"}},
        "data": {"token": base64.b64encode(b"sk_live_not_kvfleets").decode()},
    }
    secret_before = _post(plane, f"/api/v1/namespaces/{ns}/secrets", team_secret)
    team_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "stripe-gateway", "namespace": ns, "labels": {"team": "payments"}},
        "spec": {
            "selector": {"app": "payments"},
            "ports": [{"name": "https", "port": 443, "targetPort": 8443}],
        },
    }
    service_before = _post(plane, f"/api/v1/namespaces/{ns}/services", team_service)
    create(plane, _model_deployment(ns, "stripe"))

    for _ in range(2):
        reconcile(plane, ns, "stripe")

    secret = get(plane, f"/api/v1/namespaces/{ns}/secrets/stripe-keys")
    assert secret["metadata"]["resourceVersion"] == secret_before["metadata"]["resourceVersion"], secret
    assert secret["data"] == team_secret["data"]
    assert "ownerReferences" not in secret["metadata"]
    assert secret["metadata"]["labels"] == {"team": "payments"}
    service = get(plane, f"/api/v1/namespaces/{ns}/services/stripe-gateway")
    assert service["metadata"]["resourceVersion"] == service_before["metadata"]["resourceVersion"]
    assert service["spec"]["selector"] == {"app": "payments"}

    ready = condition(model_deployment(plane, ns, "stripe"))
    assert (ready.get("status"), ready.get("reason")) == ("False", reasons.NAME_IN_USE), ready
    assert f"Secret {ns}/stripe-keys" in ready["message"], ready["message"]
    assert f"Service {ns}/stripe-gateway" in ready["message"], ready["message"]
    # Nothing else of it was written: not its config, not its workloads.
    for path in (
        f"/api/v1/namespaces/{ns}/configmaps/stripe-tenants",
        f"/apis/apps/v1/namespaces/{ns}/deployments/stripe-gateway",
        f"/apis/apps/v1/namespaces/{ns}/statefulsets/stripe-engine",
    ):
        assert not _exists(plane, path), path

    # Once the team's objects are gone the name is free, and the ModelDeployment is built as usual.
    for path in (
        f"/api/v1/namespaces/{ns}/secrets/stripe-keys",
        f"/api/v1/namespaces/{ns}/services/stripe-gateway",
    ):
        assert plane.request("DELETE", path)[0] == 200
    converge(plane, ns, "stripe")
    assert condition(model_deployment(plane, ns, "stripe")).get("reason") != reasons.NAME_IN_USE
    owners = get(plane, f"/api/v1/namespaces/{ns}/secrets/stripe-keys")["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"]) for o in owners] == [("ModelDeployment", "stripe")]


def test_a_model_deployment_named_after_a_dedicated_pool_does_not_touch_it(
    api_cluster: ControlPlane, bank: str
) -> None:
    """Attack: MD ``qwen72b-dedicated-bank`` renders its shared pool under exactly the names of
    ``qwen72b``'s dedicated pool for ``bank`` (StatefulSet, headless Service, PDB, NetworkPolicy). Its
    reconcile must leave all four as they are (same resourceVersion: the bank's NetworkPolicy still admits
    only the bank's gateway, the Service still selects the bank's pods) and report ``NameInUse`` naming the
    owner; the bank stays converged."""
    plane, ns = api_cluster, bank
    before = _versions(plane, ns)
    policy_before = get(plane, BANK_POOL_OBJECTS["NetworkPolicy"].format(ns=ns))["spec"]
    create(plane, _model_deployment(ns, "qwen72b-dedicated-bank"))

    for _ in range(2):
        result, _ = reconcile(plane, ns, "qwen72b-dedicated-bank")
        assert not [a for a in result.applied if BANK_POOL in a], result.applied

    assert _versions(plane, ns) == before
    assert get(plane, BANK_POOL_OBJECTS["NetworkPolicy"].format(ns=ns))["spec"] == policy_before
    selector = get(plane, BANK_POOL_OBJECTS["Service"].format(ns=ns))["spec"]["selector"]
    assert selector.get("app.kubernetes.io/instance") == "qwen72b", selector
    ready = condition(model_deployment(plane, ns, "qwen72b-dedicated-bank"))
    assert (ready.get("status"), ready.get("reason")) == ("False", reasons.NAME_IN_USE), ready
    assert f"StatefulSet {ns}/{BANK_POOL}" in ready["message"], ready["message"]
    assert "Tenant bank" in ready["message"], ready["message"]
    assert not _exists(plane, f"/apis/apps/v1/namespaces/{ns}/deployments/qwen72b-dedicated-bank-gateway")
    # The bank's own reconcile finds none of its pool's objects to repair (on the full tier the controllers'
    # progress may still change a status: that is not the attack's doing).
    result, _ = reconcile(plane, ns, "qwen72b")
    assert not [a for a in result.applied if BANK_POOL in a], result.applied
    assert condition(tenant(plane, ns, "bank")).get("reason") != reasons.NAME_IN_USE


def test_a_tenant_whose_pool_name_is_taken_is_refused_alone(api_cluster: ControlPlane, bank: str) -> None:
    """Attack, with Tenants: a dedicated tenant ``acme`` of ModelDeployment ``qwen72b-dedicated`` renders
    its pool as ``qwen72b-dedicated-dedicated-acme-engine``; so does a dedicated tenant ``dedicated-acme``
    of ``qwen72b``. The one that comes second must not touch the first one's pool: it gets ``NameInUse``
    naming the pool's owner, nothing of it is built, and the other tenants of its ModelDeployment keep
    being served (the refusal is the tenant's, not its ModelDeployment's)."""
    plane, ns = api_cluster, bank
    pool = "qwen72b-dedicated-dedicated-acme-engine"
    create(plane, _model_deployment(ns, "qwen72b-dedicated"))
    _post(
        plane, f"{API}/namespaces/{ns}/tenants", _dedicated_tenant(ns, "acme", "qwen72b-dedicated", f"a-{ns}")
    )
    converge(plane, ns, "qwen72b-dedicated")
    sts_path = f"/apis/apps/v1/namespaces/{ns}/statefulsets/{pool}"
    owner = get(plane, sts_path)["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("Tenant", "acme")  # a dedicated pool is its tenant's
    policy_path = f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{pool}"
    before = {p: get(plane, p)["metadata"]["resourceVersion"] for p in (sts_path, policy_path)}

    second = _dedicated_tenant(ns, "dedicated-acme", "qwen72b", f"b-{ns}")
    _post(plane, f"{API}/namespaces/{ns}/tenants", second)
    for _ in range(2):
        result, _ = reconcile(plane, ns, "qwen72b")
        assert not [a for a in result.applied if pool in a], result.applied

    assert {p: get(plane, p)["metadata"]["resourceVersion"] for p in (sts_path, policy_path)} == before
    ready = condition(tenant(plane, ns, "dedicated-acme"))
    assert (ready.get("status"), ready.get("reason")) == ("False", reasons.NAME_IN_USE), ready
    assert f"StatefulSet {ns}/{pool}" in ready["message"], ready["message"]
    assert "Tenant acme" in ready["message"], ready["message"]
    # qwen72b itself and its bank are still served: the refusal is the tenant's alone.
    assert condition(model_deployment(plane, ns, "qwen72b")).get("reason") != reasons.NAME_IN_USE
    assert condition(tenant(plane, ns, "bank")).get("reason") != reasons.NAME_IN_USE


def test_an_object_wearing_the_labels_is_neither_adopted_nor_pruned(
    api_cluster: ControlPlane, bank: str
) -> None:
    """Attack: a ConfigMap that is not the operator's wears the labels the operator lists its children by
    (``kvfleet.io/model-deployment=qwen72b``). Labels are not ownership: the reconcile neither deletes it
    (it is not desired) nor counts it as a child."""
    plane, ns = api_cluster, bank
    doc = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "someone-elses",
            "namespace": ns,
            "labels": copy.deepcopy(
                get(plane, f"/api/v1/namespaces/{ns}/configmaps/qwen72b-tenants")["metadata"]["labels"]
            ),
        },
        "data": {"x": "y"},
    }
    created = _post(plane, f"/api/v1/namespaces/{ns}/configmaps", doc)
    result, _ = reconcile(plane, ns, "qwen72b")
    assert not [d for d in result.deleted if "someone-elses" in d], result.deleted
    live = get(plane, f"/api/v1/namespaces/{ns}/configmaps/someone-elses")
    assert live["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]


CHART = Path(__file__).resolve().parents[2] / "charts" / "kvfleet"
NAMES_POLICY = "kvfleet-names-model-deployment-names"


def _create_dry_run(plane: ControlPlane, namespace: str, name: str) -> tuple[int, Any]:
    path = f"{API}/namespaces/{namespace}/modeldeployments?dryRun=All"
    status, body = plane.request("POST", path, _model_deployment(namespace, name))
    return int(status), body


def test_the_chart_refuses_a_new_model_deployment_whose_pools_could_take_anothers_names(
    api_cluster: ControlPlane, bank: str
) -> None:
    """Attack, through the API server: create ``qwen72b-dedicated-bank`` (its shared pool would be
    ``qwen72b``'s pool for ``bank``) or ``qwen72b-dedicated`` (its pool for tenant ``t`` would be
    ``qwen72b``'s for tenant ``dedicated-t``). The chart's policy refuses both on create, naming the field;
    ordinary names pass; the ModelDeployments created before the policy (the earlier tests) can still be
    changed (an upgrade renames nothing and breaks nothing)."""
    plane, ns = api_cluster, bank
    # The Python naming and the policy's rule describe the same collision.
    assert engine_name("qwen72b-dedicated-bank", SHARED_POOL) == engine_name(
        "qwen72b", dedicated_pool_name("bank")
    )
    assert engine_name("x-dedicated", dedicated_pool_name("t")) == engine_name(
        "x", dedicated_pool_name("dedicated-t")
    )
    template = "templates/model-deployment-names.yaml"
    rendered = run_tool(plane, "helm", "template", "kvfleet-names", str(CHART), "-s", template)
    run_tool(plane, "kubectl", "apply", "--server-side", "--field-manager=helm", "-f", "-", stdin=rendered)
    try:
        wait_for(
            lambda: _create_dry_run(plane, ns, "probe-dedicated-x")[0] == 422,
            timeout=60,
            what="the ModelDeployment name policy in force",
        )
        for name in ("qwen72b-dedicated-bank", "qwen72b-dedicated", "a-dedicated-b-c"):
            status, body = _create_dry_run(plane, ns, name)
            message = str((body or {}).get("message", ""))
            assert status == 422 and f"ValidatingAdmissionPolicy '{NAMES_POLICY}'" in message, (status, body)
            assert f"metadata.name: {name} contains -dedicated-" in message, message
        for name in ("dedicated-qwen72b", "qwen72b-dedicatedpool", "qwen72b-eu"):
            status, body = _create_dry_run(plane, ns, name)
            assert status == 201, body
        # Created before the policy: still served and still editable (an update is never checked).
        path = f"{API}/namespaces/{ns}/modeldeployments/qwen72b-dedicated-bank"
        patch = {"spec": {"gateway": {"replicas": 1}}}
        status, body = plane.request("PATCH", path, patch, content_type="application/merge-patch+json")
        assert status == 200, body
    finally:
        run_tool(plane, "kubectl", "delete", "--ignore-not-found", "--wait=false", "-f", "-", stdin=rendered)
