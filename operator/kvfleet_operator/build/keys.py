"""API keys and cache salts: every rule about them, in one place. Pure, except the two ``new_*`` functions
(randomness); the shell (``handlers/reconcile.py``) does the reads and the writes.

Salts. The operator holds one master key (a Secret it creates on first start, at least 256 bits). Each
ModelDeployment's salt key is an HMAC of the master key and the ModelDeployment's namespace, name and
uid: a deleted or edited keys Secret is rendered again with the same salt key (no cache flush, no drift),
and a recreated ModelDeployment gets a new one. The gateway derives each request's ``cache_salt`` from
the salt key and the tenant's salt id (``kvfleet_runtime.config.derive_cache_salt``): ``shared`` tenants
use the pool's salt id, every other tenant its own, which includes its uid so that a recreated tenant
never inherits old KV.

API keys. A tenant's key lives in a Secret: the one ``spec.apiKeySecretRef`` names, else
``<tenant>-api-key`` (data key ``api-key``), which the operator generates for admitted tenants only (a
rejected tenant leaves nothing behind) and never overwrites. During a rotation the previous key stays
valid under ``<data key>-previous``. Only hashes of the keys of admitted tenants reach the data plane.

What may become a key (each rule refuses the tenant with its own condition reason):

* only a Secret marked for the tenant, label ``kvfleet.io/tenant=<tenant>`` (generated Secrets carry it):
  naming another tenant's Secret, or any other Secret of the namespace, does not turn its value into a key;
  the operator lists Secrets with :data:`API_KEY_SECRET_SELECTOR`, so an unmarked Secret is not even read;
* only a strong key (:func:`check_api_key_strength`): at least 32 characters, at least 128 bits by an
  entropy estimate, and a bearer token's characters;
* only a key no other tenant of the same ModelDeployment has (:func:`find_shared_keys`): the gateway of one
  ModelDeployment could not tell two such tenants apart, so the key is refused for both.

Tenant status shows each valid key's fingerprint (:func:`api_key_fingerprint`), never the key or its hash.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import re
import secrets
from collections import Counter
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from kvfleet_operator.api import ModelDeployment, Tenant, reasons
from kvfleet_operator.build.common import (
    LABEL_API_KEY,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_TENANT,
    MANAGED_BY,
    Obj,
    b64,
    owner_of,
)
from kvfleet_runtime.config import KeyFile, hash_api_key

#: Data key of the master key in the operator's own Secret.
MASTER_KEY_DATA_KEY = "master-key"
MASTER_KEY_BYTES = 32
#: Data key of a generated API key Secret (and the default for ``spec.apiKeySecretRef.key``).
API_KEY_DATA_KEY = "api-key"
#: During a rotation the previous key stays valid under ``<data key>-previous`` until it is removed.
PREVIOUS_SUFFIX = "-previous"
API_KEY_PREFIX = "kvf-"

#: The label that marks a Secret as holding the API key of the tenant it names (``kvfleet.io/tenant``).
TENANT_LABEL = LABEL_TENANT
#: Label selector for listing the Secrets that may hold API keys: those marked for some tenant. Which
#: tenant a Secret is for is checked per tenant (:func:`resolve_api_key_hashes`).
API_KEY_SECRET_SELECTOR = TENANT_LABEL

#: Key strength: at least this many characters...
MIN_API_KEY_LENGTH = 32
#: ...and at least this many bits by :func:`estimate_key_bits`. A random 256-bit key (what the operator
#: generates, ``openssl rand -hex 32``, ``openssl rand -base64 32``) estimates above 190 bits.
MIN_API_KEY_BITS = 128
#: An RFC 6750 bearer token (``b64token``): anything else cannot be sent as ``Authorization: Bearer``
#: (a trailing newline from ``--from-file`` would make a key no client can present).
_BEARER_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
#: ``sha256:`` and this many hex digits of the key's SHA-256 (48 bits: tells keys apart, tests none).
FINGERPRINT_PREFIX = "sha256:"
FINGERPRINT_HEX_DIGITS = 12


def new_master_key() -> bytes:
    """256 random bits."""
    return secrets.token_bytes(MASTER_KEY_BYTES)


def new_api_key() -> str:
    """``kvf-`` and 256 random bits, URL-safe."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def decode_secret_data(secret: Mapping[str, Any], key: str) -> bytes | None:
    """The decoded value under ``data[key]``; ``None`` when the Secret has no such key."""
    data = secret.get("data") or {}
    return base64.b64decode(data[key]) if key in data else None


def build_salt_master_secret(namespace: str, name: str, master_key: bytes) -> Obj:
    """The operator's master-key Secret. Created once, never overwritten (it outlives Helm releases)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {LABEL_NAME: "kvfleet"}},
        "type": "Opaque",
        "data": {MASTER_KEY_DATA_KEY: base64.b64encode(master_key).decode()},
    }


def read_salt_master(secret: Mapping[str, Any], ref: str) -> bytes:
    """The master key held by ``secret`` (named ``ref`` in the error). Raises ``ValueError`` when it is
    missing or shorter than 256 bits."""
    value = decode_secret_data(secret, MASTER_KEY_DATA_KEY)
    if value is None or len(value) < MASTER_KEY_BYTES:
        raise ValueError(
            f"Secret {ref} must hold at least {MASTER_KEY_BYTES} bytes under {MASTER_KEY_DATA_KEY!r}"
        )
    return value


def derive_salt_key_hex(master_key: bytes, md: ModelDeployment) -> str:
    """The ModelDeployment's salt key (hex): HMAC-SHA256 of the master key and namespace/name/uid."""
    meta = md.metadata
    ident = f"{meta.get('namespace')}/{meta.get('name')}/{meta.get('uid', '')}"
    return hmac.new(master_key, ident.encode(), hashlib.sha256).hexdigest()


def pool_salt_id(md: ModelDeployment) -> str:
    """The salt id every ``shared`` tenant of the ModelDeployment's pool uses (they share prefixes)."""
    meta = md.metadata
    return f"pool:{meta.get('namespace')}/{meta.get('name')}:{meta.get('uid', '')}"


def tenant_salt_id(tenant: Tenant) -> str:
    """A recreated tenant gets a new salt (the uid is part of it), so it never inherits old KV."""
    meta = tenant.metadata
    return f"tenant:{meta.get('namespace')}/{meta.get('name')}:{meta.get('uid', '')}"


def api_key_secret_ref(tenant: Tenant) -> tuple[str, str]:
    """(Secret name, data key) holding the tenant's API key."""
    ref = tenant.spec.api_key_secret_ref
    if ref is None:
        return f"{tenant.metadata['name']}-api-key", API_KEY_DATA_KEY
    return ref.name, ref.key or API_KEY_DATA_KEY


def build_api_key_secret(tenant: Tenant, secret_name: str, api_key: str) -> Obj:
    """A generated API key Secret, owned by the tenant. Created once, never overwritten."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name,
            "namespace": str(tenant.metadata["namespace"]),
            "labels": {
                LABEL_MANAGED_BY: MANAGED_BY,
                LABEL_API_KEY: "true",
                LABEL_TENANT: str(tenant.metadata["name"]),
            },
            "ownerReferences": [owner_of(tenant).reference()],
        },
        "type": "Opaque",
        "data": {API_KEY_DATA_KEY: b64(api_key)},
    }


def estimate_key_bits(key: str) -> float:
    """Bits of entropy of ``key`` as estimated from its own characters: its length times the Shannon
    entropy of their distribution. A lower bound for a random key of that alphabet; repeated or few
    distinct characters (``aaaa…``, ``abab…``) score low however long the key is."""
    if not key:
        return 0.0
    n = len(key)
    return n * sum(c / n * math.log2(n / c) for c in Counter(key).values())


def check_api_key_strength(key: str) -> str | None:
    """Why ``key`` may not be an API key (a sentence that never quotes it), or ``None`` when it may."""
    if len(key) < MIN_API_KEY_LENGTH:
        return f"is {len(key)} characters long; at least {MIN_API_KEY_LENGTH} are needed"
    if not _BEARER_TOKEN.fullmatch(key):
        return (
            "has characters a bearer token cannot carry (only letters, digits, '-._~+/' and '=' padding; "
            "no whitespace or newline)"
        )
    bits = estimate_key_bits(key)
    if bits < MIN_API_KEY_BITS:
        return (
            f"has an estimated {bits:.0f} bits of entropy (length x Shannon entropy of its characters); at "
            f"least {MIN_API_KEY_BITS} are needed"
        )
    return None


def fingerprint_of_hash(key_hash: str) -> str:
    """The fingerprint of the key whose :func:`~kvfleet_runtime.config.hash_api_key` is ``key_hash``."""
    return FINGERPRINT_PREFIX + key_hash[:FINGERPRINT_HEX_DIGITS]


def api_key_fingerprint(key: str) -> str:
    """``sha256:`` and the first 12 hex digits of SHA-256(key): what ``printf %s "$KEY" | sha256sum |
    cut -c1-12`` prints, shown in the tenant's status so a rotation can be followed."""
    return fingerprint_of_hash(hash_api_key(key))


@dataclass(frozen=True)
class KeyResolution:
    """What a tenant's API key Secret says: the hashes of its valid keys, or why there are none.

    Exactly one of ``hashes`` (non-empty; ``fingerprints`` in the same order), ``reason`` (with
    ``message``: the key is refused) and ``generate`` (no Secret yet and none referenced: the operator
    generates one once the tenant is admitted) holds.
    """

    secret_name: str
    hashes: tuple[str, ...] = ()
    fingerprints: tuple[str, ...] = ()
    reason: str | None = None
    message: str | None = None
    generate: bool = False


def _refused(secret_name: str, reason: str, message: str) -> KeyResolution:
    return KeyResolution(secret_name, reason=reason, message=message)


def _label_command(secret_name: str, namespace: str, tenant: str) -> str:
    return f"kubectl label secret {secret_name} -n {namespace} {TENANT_LABEL}={tenant}"


def resolve_api_key_hashes(tenant: Tenant, secret: Mapping[str, Any] | None) -> KeyResolution:
    """Resolve the tenant's keys from ``secret`` (the Secret :func:`api_key_secret_ref` names, ``None``
    when it does not exist or was not read): the current key, plus the previous one during a rotation.

    Refused (see the module docstring): a referenced Secret that is missing or lacks the data key
    (``ApiKeySecretNotFound``), a Secret not marked for this tenant (``ApiKeySecretNotLabelled``), a weak
    or malformed key, current or previous (``ApiKeyTooWeak``).
    """
    namespace = str(tenant.metadata.get("namespace"))
    name = str(tenant.metadata.get("name"))
    secret_name, data_key = api_key_secret_ref(tenant)
    if secret is None:
        if tenant.spec.api_key_secret_ref is None:
            return KeyResolution(secret_name, generate=True)
        return _refused(
            secret_name,
            reasons.API_KEY_SECRET_NOT_FOUND,
            f"Secret {secret_name!r} named in spec.apiKeySecretRef does not exist in namespace "
            f"{namespace!r}, or is not labelled {TENANT_LABEL}={name} (the operator reads only Secrets "
            f"marked for a tenant); create it with the API key under data key {data_key!r} and label it "
            f"({_label_command(secret_name, namespace, name)}), or remove spec.apiKeySecretRef to have one "
            "generated.",
        )
    marked_for = ((secret.get("metadata") or {}).get("labels") or {}).get(TENANT_LABEL)
    if marked_for != name:
        whose = (
            f"is labelled for tenant {marked_for!r}; a Secret is the key of one tenant only: give this "
            "tenant a Secret of its own and label it"
            if marked_for
            else "is not marked for this tenant; if it is meant to hold this tenant's key, label it"
        )
        return _refused(
            secret_name,
            reasons.API_KEY_SECRET_NOT_LABELLED,
            f"Secret {secret_name!r} {whose}: {_label_command(secret_name, namespace, name)}. Only a Secret "
            f"labelled {TENANT_LABEL}=<tenant> becomes that tenant's API key.",
        )
    hashes: list[str] = []
    for key_name in (data_key, data_key + PREVIOUS_SUFFIX):
        value = decode_secret_data(secret, key_name)
        if not value:
            if key_name == data_key:
                return _refused(
                    secret_name,
                    reasons.API_KEY_SECRET_NOT_FOUND,
                    f"Secret {secret_name!r} has no data key {data_key!r}; put the API key there.",
                )
            continue
        try:
            why = check_api_key_strength(value.decode("utf-8"))
        except UnicodeDecodeError:
            why = "is not UTF-8 text"
        if why is not None:
            return _refused(
                secret_name,
                reasons.API_KEY_TOO_WEAK,
                f"The key under data key {key_name!r} of Secret {secret_name!r} {why}, so it is not "
                'accepted. Put a random key there, e.g. "kvf-$(openssl rand -hex 32)" (the rotation recipe '
                "in docs/operations.md shows the commands).",
            )
        key_hash = hash_api_key(value.decode("utf-8"))
        if key_hash not in hashes:  # the same key under both data keys is one key
            hashes.append(key_hash)
    return KeyResolution(
        secret_name, hashes=tuple(hashes), fingerprints=tuple(fingerprint_of_hash(h) for h in hashes)
    )


def find_shared_keys(key_hashes: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """Tenant -> the other tenants that hold one of its keys, for every tenant that shares a key.

    ``key_hashes`` are the keys of the tenants of one ModelDeployment (one gateway, one key file): the
    scope in which two tenants with one key could be confused.
    """
    holders: dict[str, set[str]] = {}
    for tenant, hashes in key_hashes.items():
        for key_hash in hashes:
            holders.setdefault(key_hash, set()).add(tenant)
    shared: dict[str, set[str]] = {}
    for names in holders.values():
        if len(names) > 1:
            for tenant in names:
                shared.setdefault(tenant, set()).update(names - {tenant})
    return {tenant: tuple(sorted(others)) for tenant, others in sorted(shared.items())}


def build_key_file(salt_key_hex: str, key_hashes: Mapping[str, Sequence[str]], admitted: Set[str]) -> KeyFile:
    """The data plane's key file: the salt key and the key hashes of admitted tenants only, by name."""
    return KeyFile(
        salt_key_hex=salt_key_hex,
        key_hashes={name: list(h) for name, h in sorted(key_hashes.items()) if name in admitted},
    )
