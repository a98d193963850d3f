"""The gateways' shared store (the chart's ``gatewaySharedStore``): what every ModelDeployment's gateway
replicas are told so they split each tenant's rate limits through it (``kvfleet_runtime.gateway.shares``)
instead of enforcing ``1/replicas`` each. Pure; the operator reads the Secrets at start-up
(``handlers/reconcile.py`` ``load_gateway_store``).

The platform runs the store (Redis or Valkey) and gives the chart its URL and, in the release namespace,
a Secret with its password and optionally one with the CA that signed its TLS certificate. A gateway pod
cannot read a Secret of another namespace, so the operator copies both into each ModelDeployment's keys
Secret (data keys :data:`PASSWORD_DATA_KEY` and :data:`CA_DATA_KEY`), which the gateway and Endpoint
Picker pods already mount: the password reaches the process as ``$KVFLEET_SHARED_STORE_PASSWORD`` (a
``secretKeyRef``, never a flag), the CA as a file beside the key file. A password changed in the
platform's Secret reaches the gateways when the operator restarts.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, field_validator

from kvfleet_operator.api.common import CrdModel
from kvfleet_operator.build.common import KEYS_DIR, Obj, b64, keys_secret_name
from kvfleet_runtime.config import url_has_credentials, without_credentials

#: Data keys of the copies in each ModelDeployment's keys Secret.
PASSWORD_DATA_KEY = "shared-store-password"  # noqa: S105 - a data key's name, not a password
CA_DATA_KEY = "shared-store-ca.crt"
#: What the gateway reads the password from (``kvfleet_runtime.gateway.shared_store.PASSWORD_ENV``).
PASSWORD_ENV = "KVFLEET_SHARED_STORE_PASSWORD"  # noqa: S105 - an environment variable's name


class SecretKeyRef(CrdModel):
    """A data key of a Secret in the operator's namespace."""

    name: Annotated[str, Field(min_length=1, max_length=253)]
    key: Annotated[str, Field(min_length=1, max_length=253)]


class GatewayStoreRef(CrdModel):
    """``$KVFLEET_GATEWAY_SHARED_STORE`` (the chart's ``gatewaySharedStore``): where the store is and
    where its password and CA are."""

    url: str
    #: Where both Secrets are: the release namespace (the operator may read those two names there only).
    namespace: Annotated[str, Field(min_length=1, max_length=63)]
    password_secret: SecretKeyRef | None = None
    ca_secret: SecretKeyRef | None = None

    @field_validator("url")
    @classmethod
    def _store_url(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://")):
            raise ValueError(
                "gatewaySharedStore.url wants redis://host:port or rediss://host:port (TLS), "
                f"got {without_credentials(url)!r}"
            )
        if url_has_credentials(url):
            raise ValueError(
                "gatewaySharedStore.url carries credentials: put the password in a Secret and name it in "
                "gatewaySharedStore.passwordSecret"
            )
        return url


def parse_gateway_store(text: str | None) -> GatewayStoreRef | None:
    """The chart's value as the operator's environment carries it (JSON); ``None`` when no store is set.
    Raises ``ValueError`` (pydantic's, naming the field) for anything else."""
    if not text or not text.strip():
        return None
    return GatewayStoreRef.model_validate_json(text)


@dataclass(frozen=True)
class GatewayStore:
    """The store as the gateways get it: its URL, and the password and CA read from the Secrets."""

    url: str
    password: str | None = None
    ca_pem: str | None = None


def read_secret_key(secret: Obj | None, ref: SecretKeyRef, namespace: str, what: str) -> str:
    """The text of ``ref``'s data key in ``secret`` (as the API server returns it); ``ValueError`` that
    says what is missing and how to fix it."""
    where = f"Secret {namespace}/{ref.name}"
    if secret is None:
        raise ValueError(f"{what}: {where} does not exist; create it, or unset it in the chart's values")
    data = secret.get("data") or {}
    if ref.key not in data:
        raise ValueError(f"{what}: {where} has no data key {ref.key!r} (it has {sorted(data)})")
    try:
        text = base64.b64decode(data[ref.key], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{what}: {where} key {ref.key!r} is not UTF-8 text") from None
    if not text.strip():
        raise ValueError(f"{what}: {where} key {ref.key!r} is empty")
    return text


def gateway_store_args(store: GatewayStore | None) -> list[str]:
    """``kvfleet gateway`` / ``kvfleet epp`` flags for the store (none without one)."""
    if store is None:
        return []
    args = ["--shared-store", store.url]
    if store.ca_pem is not None:
        args += ["--shared-store-ca", f"{KEYS_DIR}/{CA_DATA_KEY}"]
    return args


def gateway_store_env(store: GatewayStore | None, model_deployment: str) -> list[Obj]:
    """The password from the ModelDeployment's keys Secret, as the gateway's environment."""
    if store is None or store.password is None:
        return []
    ref = {"name": keys_secret_name(model_deployment), "key": PASSWORD_DATA_KEY}
    return [{"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": ref}}]


def gateway_store_secret_data(store: GatewayStore | None) -> dict[str, str]:
    """What the keys Secret carries for the store (base64, as a Secret's ``data``)."""
    if store is None:
        return {}
    data: dict[str, str] = {}
    if store.password is not None:
        data[PASSWORD_DATA_KEY] = b64(store.password)
    if store.ca_pem is not None:
        data[CA_DATA_KEY] = b64(store.ca_pem)
    return data
