"""API keys and cache salts (build/keys.py): resolution from Secrets, derivation, the key file."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from kvfleet_operator.api import ModelDeployment, Tenant
from kvfleet_operator.build import keys
from kvfleet_operator.build.keys import KeyResolution
from kvfleet_runtime.config import KeyFile, hash_api_key

MASTER = b"m" * 32


def _tenant(name: str = "saas", uid: str = "t-uid", ref: dict[str, str] | None = None) -> Tenant:
    spec: dict[str, Any] = {"modelDeploymentRef": {"name": "m"}}
    if ref is not None:
        spec["apiKeySecretRef"] = ref
    return Tenant.model_validate({"metadata": {"name": name, "namespace": "ns", "uid": uid}, "spec": spec})


def _md(name: str = "m", namespace: str = "ns", uid: str = "md-uid") -> ModelDeployment:
    return ModelDeployment.model_construct(metadata={"name": name, "namespace": namespace, "uid": uid})


def _secret(**data: str) -> dict[str, Any]:
    return {"data": {k.replace("_", "-"): base64.b64encode(v.encode()).decode() for k, v in data.items()}}


@pytest.mark.parametrize(
    ("tenant", "secret", "expected"),
    [
        pytest.param(
            _tenant(), None, KeyResolution("saas-api-key", generate=True), id="no-ref-no-secret-generate"
        ),
        pytest.param(
            _tenant(),
            _secret(api_key="k1"),
            KeyResolution("saas-api-key", hashes=(hash_api_key("k1"),)),
            id="generated-secret-exists",
        ),
        pytest.param(
            _tenant(),
            _secret(api_key="k2", api_key_previous="k1"),
            KeyResolution("saas-api-key", hashes=(hash_api_key("k2"), hash_api_key("k1"))),
            id="rotation-keeps-the-previous-key-valid",
        ),
        pytest.param(
            _tenant(ref={"name": "own", "key": "token"}),
            _secret(token="t1", token_previous="t0"),
            KeyResolution("own", hashes=(hash_api_key("t1"), hash_api_key("t0"))),
            id="referenced-secret-and-data-key",
        ),
        pytest.param(
            _tenant(ref={"name": "own"}),
            _secret(api_key="k1"),
            KeyResolution("own", hashes=(hash_api_key("k1"),)),
            id="referenced-secret-default-data-key",
        ),
        pytest.param(
            _tenant(ref={"name": "own"}),
            None,
            KeyResolution(
                "own",
                missing="Secret 'own' named in spec.apiKeySecretRef does not exist in namespace 'ns'; create "
                "it with the API key under data key 'api-key', or remove spec.apiKeySecretRef to have one "
                "generated.",
            ),
            id="referenced-secret-missing-is-never-generated",
        ),
        pytest.param(
            _tenant(ref={"name": "own", "key": "token"}),
            _secret(api_key="k1"),
            KeyResolution("own", missing="Secret 'own' has no data key 'token'; put the API key there."),
            id="referenced-data-key-missing",
        ),
        pytest.param(
            _tenant(),
            _secret(api_key=""),
            KeyResolution(
                "saas-api-key",
                missing="Secret 'saas-api-key' has no data key 'api-key'; put the API key there.",
            ),
            id="empty-key-is-no-key",
        ),
    ],
)
def test_resolve_api_key_hashes(
    tenant: Tenant, secret: dict[str, Any] | None, expected: KeyResolution
) -> None:
    assert keys.resolve_api_key_hashes(tenant, secret) == expected


def test_hashes_never_contain_the_key() -> None:
    resolution = keys.resolve_api_key_hashes(_tenant(), _secret(api_key="kvf-secret"))
    assert all("kvf-secret" not in h for h in resolution.hashes)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        pytest.param(_md(), _md(), True, id="same-object-same-key"),
        pytest.param(_md(), _md(uid="other"), False, id="recreated-model-deployment-new-key"),
        pytest.param(_md(), _md(name="n"), False, id="other-name"),
        pytest.param(_md(), _md(namespace="other"), False, id="other-namespace"),
    ],
)
def test_salt_key_derivation(a: ModelDeployment, b: ModelDeployment, same: bool) -> None:
    key_a, key_b = keys.derive_salt_key_hex(MASTER, a), keys.derive_salt_key_hex(MASTER, b)
    assert (key_a == key_b) is same
    assert len(key_a) == 64 and int(key_a, 16) >= 0
    # The key file accepts it (64 hex digits or more).
    KeyFile(salt_key_hex=key_a, key_hashes={})


def test_salt_key_depends_on_the_master_key() -> None:
    assert keys.derive_salt_key_hex(MASTER, _md()) != keys.derive_salt_key_hex(b"n" * 32, _md())


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        pytest.param(_tenant(), _tenant(), True, id="stable"),
        pytest.param(_tenant(), _tenant(uid="new"), False, id="recreated-tenant-never-inherits-old-kv"),
        pytest.param(_tenant(), _tenant(name="other"), False, id="other-tenant"),
    ],
)
def test_tenant_salt_id(a: Tenant, b: Tenant, same: bool) -> None:
    assert (keys.tenant_salt_id(a) == keys.tenant_salt_id(b)) is same


def test_pool_and_tenant_salt_ids_never_meet() -> None:
    assert keys.pool_salt_id(_md()) != keys.tenant_salt_id(_tenant())
    assert keys.pool_salt_id(_md()) != keys.pool_salt_id(_md(uid="recreated"))


@pytest.mark.parametrize(
    ("tenant", "expected"),
    [
        pytest.param(_tenant(), ("saas-api-key", "api-key"), id="generated"),
        pytest.param(_tenant(ref={"name": "own"}), ("own", "api-key"), id="referenced-default-key"),
        pytest.param(_tenant(ref={"name": "own", "key": "k"}), ("own", "k"), id="referenced-key"),
    ],
)
def test_api_key_secret_ref(tenant: Tenant, expected: tuple[str, str]) -> None:
    assert keys.api_key_secret_ref(tenant) == expected


def test_generated_api_key_secret_is_owned_by_the_tenant_and_marked_as_its_key() -> None:
    secret = keys.build_api_key_secret(_tenant(), "saas-api-key", "kvf-abc")
    assert secret["metadata"]["name"] == "saas-api-key"
    assert secret["metadata"]["namespace"] == "ns"
    assert secret["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "kvfleet-operator",
        "kvfleet.io/api-key": "true",
        "kvfleet.io/tenant": "saas",
    }
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("Tenant", "t-uid", True)
    # Read back by the resolver, it is the tenant's key.
    assert keys.resolve_api_key_hashes(_tenant(), secret).hashes == (hash_api_key("kvf-abc"),)


def test_new_keys_are_long_and_different() -> None:
    first, second = keys.new_api_key(), keys.new_api_key()
    assert first != second and first.startswith("kvf-") and len(first) >= 4 + 43
    assert len(keys.new_master_key()) == 32


@pytest.mark.parametrize(
    ("secret", "error"),
    [
        pytest.param({"data": {"master-key": base64.b64encode(b"x" * 31).decode()}}, True, id="too-short"),
        pytest.param({"data": {}}, True, id="missing"),
        pytest.param({}, True, id="no-data"),
        pytest.param({"data": {"master-key": base64.b64encode(b"x" * 32).decode()}}, False, id="256-bits"),
    ],
)
def test_read_salt_master(secret: dict[str, Any], error: bool) -> None:
    if error:
        with pytest.raises(ValueError, match="ns/master must hold at least 32 bytes under 'master-key'"):
            keys.read_salt_master(secret, "ns/master")
    else:
        assert keys.read_salt_master(secret, "ns/master") == b"x" * 32


def test_salt_master_secret_round_trips() -> None:
    secret = keys.build_salt_master_secret("kvfleet-system", "master", MASTER)
    assert (secret["metadata"]["namespace"], secret["metadata"]["name"]) == ("kvfleet-system", "master")
    assert "ownerReferences" not in secret["metadata"]  # it outlives every release and object
    assert keys.read_salt_master(secret, "kvfleet-system/master") == MASTER


@pytest.mark.parametrize(
    ("hashes", "admitted", "expected"),
    [
        pytest.param({"a": ("h1",), "b": ("h2",)}, {"a"}, {"a": ["h1"]}, id="only-admitted-tenants"),
        pytest.param(
            {"b": ("h2",), "a": ("h1", "h0")}, {"a", "b"}, {"a": ["h1", "h0"], "b": ["h2"]}, id="sorted"
        ),
        pytest.param({}, {"a"}, {}, id="admitted-without-key"),
    ],
)
def test_build_key_file(
    hashes: dict[str, tuple[str, ...]], admitted: set[str], expected: dict[str, list[str]]
) -> None:
    real = {name: tuple(hash_api_key(h) for h in hs) for name, hs in hashes.items()}
    key_file = keys.build_key_file("ab" * 32, real, admitted)
    assert key_file.salt_key_hex == "ab" * 32
    assert key_file.key_hashes == {name: [hash_api_key(h) for h in hs] for name, hs in expected.items()}
    assert list(key_file.key_hashes) == sorted(key_file.key_hashes)
