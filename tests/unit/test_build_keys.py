"""API keys and cache salts (build/keys.py): resolution from Secrets, derivation, the key file."""

from __future__ import annotations

import base64
import hashlib
import secrets
from typing import Any

import pytest

from kvfleet_operator.api import ModelDeployment, Tenant, reasons
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


#: Strong keys (random-looking, 47 characters): what a tenant's Secret holds.
K1, K2, K0 = ("kvf-" + c * 3 + "Qm9vZ3h0dVlXa1p6dEJwNjNmV0pxTkRySG9L" + c * 4 for c in "xyz")


def _secret(tenant: str | None = "saas", **data: str) -> dict[str, Any]:
    """A Secret with ``data`` (``api_key_previous`` -> ``api-key-previous``), marked for ``tenant``."""
    labels = {"kvfleet.io/tenant": tenant} if tenant else {}
    return {
        "metadata": {"name": "s", "labels": labels},
        "data": {k.replace("_", "-"): base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def _ok(secret_name: str, *keys_: str) -> KeyResolution:
    hashes = tuple(hash_api_key(k) for k in keys_)
    return KeyResolution(secret_name, hashes=hashes, fingerprints=tuple(f"sha256:{h[:12]}" for h in hashes))


@pytest.mark.parametrize(
    ("tenant", "secret", "expected"),
    [
        pytest.param(
            _tenant(), None, KeyResolution("saas-api-key", generate=True), id="no-ref-no-secret-generate"
        ),
        pytest.param(_tenant(), _secret(api_key=K1), _ok("saas-api-key", K1), id="generated-secret-exists"),
        pytest.param(
            _tenant(),
            _secret(api_key=K2, api_key_previous=K1),
            _ok("saas-api-key", K2, K1),
            id="rotation-keeps-the-previous-key-valid",
        ),
        pytest.param(
            _tenant(), _secret(api_key=K1, api_key_previous=K1), _ok("saas-api-key", K1), id="same-key-twice"
        ),
        pytest.param(
            _tenant(ref={"name": "own", "key": "token"}),
            _secret(token=K1, token_previous=K0),
            _ok("own", K1, K0),
            id="referenced-secret-and-data-key",
        ),
        pytest.param(
            _tenant(ref={"name": "own"}),
            _secret(api_key=K1),
            _ok("own", K1),
            id="referenced-default-data-key",
        ),
    ],
)
def test_resolve_api_key_hashes(
    tenant: Tenant, secret: dict[str, Any] | None, expected: KeyResolution
) -> None:
    assert keys.resolve_api_key_hashes(tenant, secret) == expected


@pytest.mark.parametrize(
    ("tenant", "secret", "reason", "says"),
    [
        pytest.param(
            _tenant(ref={"name": "own"}),
            None,
            reasons.API_KEY_SECRET_NOT_FOUND,
            [
                "Secret 'own' named in spec.apiKeySecretRef does not exist in namespace 'ns', or is not "
                "labelled kvfleet.io/tenant=saas",
                "kubectl label secret own -n ns kvfleet.io/tenant=saas",
                "remove spec.apiKeySecretRef",
            ],
            id="referenced-secret-missing-is-never-generated",
        ),
        pytest.param(
            _tenant(ref={"name": "own", "key": "token"}),
            _secret(api_key=K1),
            reasons.API_KEY_SECRET_NOT_FOUND,
            ["Secret 'own' has no data key 'token'; put the API key there."],
            id="referenced-data-key-missing",
        ),
        pytest.param(
            _tenant(),
            _secret(api_key=""),
            reasons.API_KEY_SECRET_NOT_FOUND,
            ["Secret 'saas-api-key' has no data key 'api-key'"],
            id="empty-key-is-no-key",
        ),
        pytest.param(
            _tenant(ref={"name": "own"}),
            _secret(None, api_key=K1),
            reasons.API_KEY_SECRET_NOT_LABELLED,
            ["is not marked for this tenant", "kubectl label secret own -n ns kvfleet.io/tenant=saas"],
            id="unmarked-secret",
        ),
        pytest.param(
            _tenant(ref={"name": "bank-api-key"}),
            _secret("bank", api_key=K1),
            reasons.API_KEY_SECRET_NOT_LABELLED,
            ["is labelled for tenant 'bank'", "a Secret is the key of one tenant only"],
            id="another-tenants-secret",
        ),
        pytest.param(
            _tenant(),
            _secret(api_key="a" * 40),
            reasons.API_KEY_TOO_WEAK,
            ["data key 'api-key'", "estimated 0 bits", "openssl rand -hex 32"],
            id="one-repeated-character",
        ),
        pytest.param(
            _tenant(),
            _secret(api_key=K1, api_key_previous="hunter2"),
            reasons.API_KEY_TOO_WEAK,
            ["data key 'api-key-previous'", "is 7 characters long; at least 32 are needed"],
            id="a-weak-previous-key-is-refused-too",
        ),
        pytest.param(
            _tenant(),
            _secret(api_key=K1 + "\n"),
            reasons.API_KEY_TOO_WEAK,
            ["characters a bearer token cannot carry"],
            id="trailing-newline-of-from-file",
        ),
        pytest.param(
            _tenant(),
            {"metadata": {"labels": {"kvfleet.io/tenant": "saas"}}, "data": {"api-key": "//79/w=="}},
            reasons.API_KEY_TOO_WEAK,
            ["is not UTF-8 text"],
            id="binary",
        ),
    ],
)
def test_refused_keys_say_why_and_what_to_do(
    tenant: Tenant, secret: dict[str, Any] | None, reason: str, says: list[str]
) -> None:
    resolution = keys.resolve_api_key_hashes(tenant, secret)
    assert (resolution.reason, resolution.hashes, resolution.generate) == (reason, (), False)
    for part in says:
        assert part in (resolution.message or "")


def test_hashes_never_contain_the_key() -> None:
    resolution = keys.resolve_api_key_hashes(_tenant(), _secret(api_key=K1))
    assert all(K1 not in h for h in resolution.hashes)


def test_a_refusal_never_quotes_the_key() -> None:
    weak = "kvf-" + "ab" * 20
    resolution = keys.resolve_api_key_hashes(_tenant(), _secret(api_key=weak))
    assert resolution.reason == reasons.API_KEY_TOO_WEAK
    assert weak not in (resolution.message or "") and "abab" not in (resolution.message or "")


@pytest.mark.parametrize(
    ("key", "weak"),
    [
        pytest.param("x" * 31, "is 31 characters long", id="short"),
        pytest.param("0123456789" * 4, "estimated 133 bits", id="ten-symbols-only-just-pass"),
        pytest.param("ab" * 32, "estimated 64 bits", id="two-symbols"),
        pytest.param("kvf-bank-test-key-0123456789abcdef", None, id="34-mixed-characters"),
        pytest.param("with space " * 4, "bearer token", id="space"),
        pytest.param("Zm9vYmFy" * 3 + "YmF6cXV4cXV1eA==", None, id="base64-padding"),
    ],
)
def test_key_strength_rule(key: str, weak: str | None) -> None:
    why = keys.check_api_key_strength(key)
    if weak is None or weak.startswith("estimated 133"):
        assert why is None, why
    else:
        assert why is not None and weak in why


def test_random_256_bit_keys_always_pass_with_a_margin() -> None:
    """The generators the docs recommend never trip the estimate: the lowest of many draws stays far above
    the 128-bit floor (a refused key that is really random would be a false alarm)."""
    draws = [keys.new_api_key() for _ in range(2000)]
    draws += [secrets.token_hex(32) for _ in range(2000)]  # openssl rand -hex 32
    draws += [base64.b64encode(secrets.token_bytes(32)).decode() for _ in range(2000)]  # -base64 32
    assert all(keys.check_api_key_strength(k) is None for k in draws)
    assert min(keys.estimate_key_bits(k) for k in draws) > 1.4 * keys.MIN_API_KEY_BITS


def test_fingerprint_is_a_prefix_of_the_hash_not_the_key() -> None:
    fingerprint = keys.api_key_fingerprint(K1)
    assert fingerprint == "sha256:" + hashlib.sha256(K1.encode()).hexdigest()[:12]
    assert fingerprint == keys.fingerprint_of_hash(hash_api_key(K1))
    assert K1 not in fingerprint and len(fingerprint) == len("sha256:") + 12


@pytest.mark.parametrize(
    ("hashes", "shared"),
    [
        pytest.param({"a": ("h1",), "b": ("h2",)}, {}, id="distinct"),
        pytest.param({"a": ("h1",), "b": ("h1",)}, {"a": ("b",), "b": ("a",)}, id="same-key"),
        pytest.param(
            {"a": ("h1", "h0"), "b": ("h2", "h0"), "c": ("h3",)},
            {"a": ("b",), "b": ("a",)},
            id="previous-keys-count",
        ),
        pytest.param(
            {"a": ("h1",), "b": ("h1",), "c": ("h1",)},
            {"a": ("b", "c"), "b": ("a", "c"), "c": ("a", "b")},
            id="three-holders",
        ),
    ],
)
def test_find_shared_keys(hashes: dict[str, tuple[str, ...]], shared: dict[str, tuple[str, ...]]) -> None:
    assert keys.find_shared_keys(hashes) == shared


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
    secret = keys.build_api_key_secret(_tenant(), "saas-api-key", K1)
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
    assert keys.resolve_api_key_hashes(_tenant(), secret).hashes == (hash_api_key(K1),)


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
