"""Attacks on tenant identity through API keys, against the operator's reconcile and the real API server.

A key must identify exactly one tenant: each test below is one way to break that, and shows the
operator refusing it loudly (a condition naming the reason, an Event) while nothing of the key reaches
the gateway's key file. The gateway's own refusal of a key listed for two tenants is
tests/security/test_gateway_attacks.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from devcluster import ControlPlane

from kvfleet_runtime.config import hash_api_key
from operator_support import (
    condition,
    converge,
    create,
    events_of,
    key_file,
    key_secret,
    load_example,
    secret_value,
    strong_key,
    tenant,
    tenant_table,
    tiny_namespace,
)

#: The reasons of an admitted tenant: serving, or waiting for its pool (no kubelet runs pods on the
#: API-server-only tier).
ADMITTED = ("Ready", "ModelDeploymentNotReady")


@pytest.fixture
def namespace(api_cluster: ControlPlane) -> Iterator[str]:
    """The CPU example ModelDeployment with its premium and basic-a tenants, admitted and keyed."""
    for ns in tiny_namespace(api_cluster, "keys", ("premium", "basic-a")):
        converge(api_cluster, ns, "tiny")
        yield ns


def _tenant(namespace: str, name: str, secret: str | None = None) -> dict[str, object]:
    """A small salted tenant of ``tiny``, its key in Secret ``secret`` (generated when ``None``)."""
    doc = load_example("local/tenant-basic-a.yaml", namespace)
    doc["metadata"]["name"] = name
    doc["spec"].update(isolation="salted", kvQuota={"hbm": "1%"})
    if secret is not None:
        doc["spec"]["apiKeySecretRef"] = {"name": secret}
    return doc


def _hashes(plane: ControlPlane, namespace: str) -> set[str]:
    return {h for hs in key_file(plane, namespace, "tiny").key_hashes.values() for h in hs}


def test_two_tenants_with_one_key_are_both_refused_loudly(api_cluster: ControlPlane, namespace: str) -> None:
    """Threat: a second tenant is given the key of a serving one (copied, or guessed from a leak). The
    gateway would map the key to one of them, and the victim's traffic would run under another tenant's
    salt, priority and limits. Both are refused, each told who the other is, and the key leaves the key
    file; deleting the copy brings the victim back at the quota it had."""
    plane = api_cluster
    victim_key = secret_value(plane, namespace, "premium-api-key")
    assert victim_key is not None and hash_api_key(victim_key) in _hashes(plane, namespace)
    admitted = tenant(plane, namespace, "premium")["status"]["admittedQuota"]

    create(plane, key_secret(namespace, "copycat-key", victim_key, tenant="copycat"))
    create(plane, _tenant(namespace, "copycat", secret="copycat-key"))
    converge(plane, namespace, "tiny")

    for name, other in (("premium", "copycat"), ("copycat", "premium")):
        ready = condition(tenant(plane, namespace, name))
        assert (ready["status"], ready["reason"]) == ("False", "ApiKeyShared")
        assert f"'{other}'" in ready["message"] and victim_key not in ready["message"]
        assert ("Warning", "ApiKeyShared") in events_of(plane, namespace, name)
    assert hash_api_key(victim_key) not in _hashes(plane, namespace)
    assert set(tenant_table(plane, namespace, "tiny").tenants) == {"basic-a"}  # the bystander serves on
    # The victim keeps the room it was admitted with.
    assert tenant(plane, namespace, "premium")["status"]["admittedQuota"] == admitted

    plane.request("DELETE", f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenants/copycat")
    converge(plane, namespace, "tiny")
    assert hash_api_key(victim_key) in _hashes(plane, namespace)
    assert condition(tenant(plane, namespace, "premium"))["reason"] in ADMITTED
    assert tenant(plane, namespace, "premium")["status"]["admittedQuota"] == admitted


def test_naming_another_tenants_secret_does_not_make_its_key_yours(
    api_cluster: ControlPlane, namespace: str
) -> None:
    """Threat: a tenant's spec names a Secret it does not own (another tenant's generated key, or any
    Secret of the namespace) in apiKeySecretRef, turning that value into its own key. Only a Secret
    labelled for the tenant becomes its key."""
    plane = api_cluster
    create(plane, _tenant(namespace, "thief", secret="premium-api-key"))
    converge(plane, namespace, "tiny")
    ready = condition(tenant(plane, namespace, "thief"))
    assert (ready["status"], ready["reason"]) == ("False", "ApiKeySecretNotLabelled")
    assert "is labelled for tenant 'premium'" in ready["message"]
    assert "thief" not in key_file(plane, namespace, "tiny").key_hashes
    # The owner is not harmed: no shared-key refusal, since the thief never got the key.
    assert condition(tenant(plane, namespace, "premium"))["reason"] in ADMITTED


def test_an_unlabelled_secret_is_not_read_until_it_is_marked(
    api_cluster: ControlPlane, namespace: str
) -> None:
    """Threat: any Secret of the namespace (a database password, a TLS key) becomes an API key because
    a Tenant names it. The operator lists only Secrets labelled kvfleet.io/tenant; the condition says
    how to mark one, and once marked for this tenant it serves."""
    plane = api_cluster
    key = strong_key()
    create(plane, key_secret(namespace, "plain-key", key, tenant=None))
    create(plane, _tenant(namespace, "plain", secret="plain-key"))
    converge(plane, namespace, "tiny")
    ready = condition(tenant(plane, namespace, "plain"))
    assert ready["reason"] == "ApiKeySecretNotFound"
    assert f"kubectl label secret plain-key -n {namespace} kvfleet.io/tenant=plain" in ready["message"]
    assert hash_api_key(key) not in _hashes(plane, namespace)

    patch = {"metadata": {"labels": {"kvfleet.io/tenant": "plain"}}}
    status, body = plane.request(
        "PATCH",
        f"/api/v1/namespaces/{namespace}/secrets/plain-key",
        patch,
        content_type="application/merge-patch+json",
    )
    assert status == 200, body
    converge(plane, namespace, "tiny")
    assert key_file(plane, namespace, "tiny").key_hashes["plain"] == [hash_api_key(key)]


@pytest.mark.parametrize(
    ("key", "says"),
    [
        pytest.param("kvf-secret", "is 10 characters long", id="short"),
        pytest.param("kvf-" + "ab" * 20, "bits of entropy", id="low-entropy"),
        pytest.param(strong_key() + "\n", "bearer token", id="trailing-newline"),
    ],
)
def test_a_weak_key_is_refused(api_cluster: ControlPlane, namespace: str, key: str, says: str) -> None:
    """Threat: a guessable key (short, repetitive) lets anyone spend the tenant's quota and read its
    cache hits; a key with a newline is one no client can send. Refused with the reason and a recipe."""
    plane = api_cluster
    create(plane, key_secret(namespace, "weak-key", key, tenant="weak"))
    create(plane, _tenant(namespace, "weak", secret="weak-key"))
    converge(plane, namespace, "tiny")
    ready = condition(tenant(plane, namespace, "weak"))
    assert (ready["reason"], ready["status"]) == ("ApiKeyTooWeak", "False")
    assert says in ready["message"] and "openssl rand -hex 32" in ready["message"]
    assert key.strip() not in ready["message"]
    assert (
        hash_api_key(key) not in _hashes(plane, namespace)
        and "weak" not in tenant_table(plane, namespace, "tiny").tenants
    )
