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
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from kvfleet_operator.api import ModelDeployment, Tenant
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


@dataclass(frozen=True)
class KeyResolution:
    """What a tenant's API key Secret says: the hashes of its valid keys, or why there are none.

    Exactly one of ``hashes`` (non-empty), ``missing`` (a message for ``ApiKeySecretNotFound``) and
    ``generate`` (no Secret yet and none referenced: the operator generates one once the tenant is
    admitted) holds.
    """

    secret_name: str
    hashes: tuple[str, ...] = ()
    missing: str | None = None
    generate: bool = False


def resolve_api_key_hashes(tenant: Tenant, secret: Mapping[str, Any] | None) -> KeyResolution:
    """Resolve the tenant's keys from ``secret`` (the Secret :func:`api_key_secret_ref` names, ``None``
    when it does not exist): the current key, plus the previous one during a rotation."""
    namespace = str(tenant.metadata.get("namespace"))
    secret_name, data_key = api_key_secret_ref(tenant)
    if secret is None:
        if tenant.spec.api_key_secret_ref is None:
            return KeyResolution(secret_name, generate=True)
        return KeyResolution(
            secret_name,
            missing=f"Secret {secret_name!r} named in spec.apiKeySecretRef does not exist in namespace "
            f"{namespace!r}; create it with the API key under data key {data_key!r}, or remove "
            "spec.apiKeySecretRef to have one generated.",
        )
    current = decode_secret_data(secret, data_key)
    if not current:
        return KeyResolution(
            secret_name,
            missing=f"Secret {secret_name!r} has no data key {data_key!r}; put the API key there.",
        )
    hashes = [hash_api_key(current.decode())]
    previous = decode_secret_data(secret, data_key + PREVIOUS_SUFFIX)
    if previous:
        hashes.append(hash_api_key(previous.decode()))
    return KeyResolution(secret_name, hashes=tuple(hashes))


def build_key_file(salt_key_hex: str, key_hashes: Mapping[str, Sequence[str]], admitted: Set[str]) -> KeyFile:
    """The data plane's key file: the salt key and the key hashes of admitted tenants only, by name."""
    return KeyFile(
        salt_key_hex=salt_key_hex,
        key_hashes={name: list(h) for name, h in sorted(key_hashes.items()) if name in admitted},
    )
