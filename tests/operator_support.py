"""Running the operator's reconcile against the real API server, for the attack tests (tests/security)
and the key rotation test (tests/cluster/test_key_rotation.py).

The reconcile is the one every kopf handler calls (``reconcile_model_deployment``), run in process so
that a test can count its mutating API calls; the API server is the session's real one
(``api_cluster``/``full_cluster`` in tests/cluster_fixtures.py).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import secrets
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from devcluster import ControlPlane

from kvfleet_operator.build.gpu_groups import GroupBinding
from kvfleet_operator.build.model_deployment import OperatorImages
from kvfleet_operator.handlers.reconcile import OperatorConfig, ReconcileResult, reconcile_model_deployment
from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.client import Credentials, KubeClient
from kvfleet_runtime.config import KeyFile, TenantTable

# tests/cluster/ is no package: pytest puts it on sys.path for its own tests; the same module for these.
sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))
# apply_crds, create_namespace, delete_namespace: re-exported (tests/engine/test_onboarding.py).
from cluster_helpers import apply_crds, create_namespace, delete_namespace, scratch_namespace  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CONFIG = OperatorConfig(
    images=OperatorImages(engine="kvfleet-engine:test", gateway="kvfleet:test"), salt_master=b"m" * 32
)
API = "/apis/kvfleet.io/v1alpha1"


def strong_key() -> str:
    """A key as the docs recommend making one (``kvf-$(openssl rand -hex 32)``)."""
    return "kvf-" + secrets.token_hex(32)


def fingerprint(key: str) -> str:
    """What ``printf %s "$KEY" | sha256sum | cut -c1-12`` prints, with the status's ``sha256:`` prefix."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:12]


def load_example(name: str, namespace: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"]["namespace"] = namespace
    return doc


def bind_namespace_groups(plane: ControlPlane, namespace: str, config: OperatorConfig) -> OperatorConfig:
    """``config`` with each dedicated GPU group a Tenant of ``namespace`` names bound to that namespace, as
    a platform administrator sets ``dedicatedGpuGroups.owners`` for the teams it gives groups to. A config
    that binds groups itself is returned as it is: the tests of the binding rule say whom they bind."""
    if config.gpu_group_owners:
        return config
    status, body = plane.request("GET", f"{API}/namespaces/{namespace}/tenants")
    assert status == 200, body
    groups = {((t.get("spec") or {}).get("dedicated") or {}).get("gpuGroup") for t in body["items"]}
    return replace(config, gpu_group_owners={g: GroupBinding(namespace) for g in groups if g})


def reconcile(
    plane: ControlPlane, namespace: str, name: str, config: OperatorConfig = CONFIG
) -> tuple[ReconcileResult, int]:
    """One reconcile with ``config`` (its dedicated GPU groups bound to ``namespace`` unless it binds some:
    :func:`bind_namespace_groups`); returns its result and the number of mutating API calls it made."""
    config = bind_namespace_groups(plane, namespace, config)

    async def go() -> tuple[ReconcileResult, int]:
        async with KubeClient(Credentials.from_kubeconfig(plane.kubeconfig)) as client:
            result = await reconcile_model_deployment(client, config, namespace, name)
            return result, client.mutating_calls

    return asyncio.run(go())


def converge(
    plane: ControlPlane, namespace: str, name: str, rounds: int = 6, config: OperatorConfig = CONFIG
) -> int:
    """Reconcile until a round mutates nothing; returns the rounds it took."""
    for i in range(1, rounds + 1):
        if reconcile(plane, namespace, name, config)[1] == 0:
            return i
    raise AssertionError(f"{namespace}/{name} did not converge in {rounds} reconciles")


def workloads_ready(plane: ControlPlane, namespace: str, name: str) -> None:
    """What the StatefulSet and Deployment controllers report once the pods of ModelDeployment ``name``
    run (the API tier runs no controllers; on the full tier kwok's pods get there by themselves and the
    controllers may write their own figures over these). Not created yet: nothing to do."""
    for kind, child in ((kinds.STATEFUL_SET, f"{name}-engine"), (kinds.DEPLOYMENT, f"{name}-gateway")):
        status, body = plane.request(
            "PATCH",
            kind.path(namespace, child) + "/status",
            {"status": {"replicas": 1, "readyReplicas": 1}},
            content_type="application/merge-patch+json",
        )
        assert status in (200, 404), body


def create(plane: ControlPlane, doc: dict[str, Any]) -> dict[str, Any]:
    namespace = doc["metadata"]["namespace"]
    path = {
        "ModelDeployment": f"{API}/namespaces/{namespace}/modeldeployments",
        "Tenant": f"{API}/namespaces/{namespace}/tenants",
        "Secret": f"/api/v1/namespaces/{namespace}/secrets",
    }[doc["kind"]]
    status, body = plane.request("POST", path, doc)
    assert status == 201, body
    created: dict[str, Any] = body
    return created


def get(plane: ControlPlane, path: str) -> dict[str, Any]:
    status, body = plane.request("GET", path)
    assert status == 200, (path, body)
    found: dict[str, Any] = body
    return found


def model_deployment(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    return get(plane, f"{API}/namespaces/{namespace}/modeldeployments/{name}")


def tenant(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    return get(plane, f"{API}/namespaces/{namespace}/tenants/{name}")


def condition(obj: dict[str, Any], kind: str = "Ready") -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            found: dict[str, Any] = cond
            return found
    return {}


def key_secret(
    namespace: str, name: str, key: str, *, tenant: str | None, previous: str | None = None
) -> dict[str, Any]:
    """A key Secret, labelled ``kvfleet.io/tenant=<tenant>`` unless ``tenant`` is ``None``."""
    data = {"api-key": key} | ({"api-key-previous": previous} if previous else {})
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kvfleet.io/tenant": tenant} if tenant else {},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def secret_value(plane: ControlPlane, namespace: str, name: str, data_key: str = "api-key") -> str | None:
    data = get(plane, f"/api/v1/namespaces/{namespace}/secrets/{name}").get("data") or {}
    return base64.b64decode(data[data_key]).decode() if data_key in data else None


def key_file(plane: ControlPlane, namespace: str, md: str) -> KeyFile:
    """The keys Secret the operator rendered for the gateway of ``md``."""
    secret = get(plane, f"/api/v1/namespaces/{namespace}/secrets/{md}-keys")
    return KeyFile.model_validate_json(base64.b64decode(secret["data"]["keys.json"]))


def tenant_table(plane: ControlPlane, namespace: str, md: str) -> TenantTable:
    cm = get(plane, f"/api/v1/namespaces/{namespace}/configmaps/{md}-tenants")
    return TenantTable.model_validate_json(cm["data"]["tenants.json"])


def events_of(plane: ControlPlane, namespace: str, name: str) -> list[tuple[str, str]]:
    """(type, reason) of the Events about object ``name``: what ``kubectl describe`` lists."""
    events = get(plane, f"/api/v1/namespaces/{namespace}/events")["items"]
    return [(e["type"], e["reason"]) for e in events if e["involvedObject"]["name"] == name]


def schedulable_on_kwok(md: dict[str, Any]) -> dict[str, Any]:
    """``md`` with its model source swapped for a Hugging Face id (a download into an emptyDir cache). On
    the full tier the StatefulSet controller creates the engine pod, and no storage provisioner here binds
    the CPU example's claim, so the pod would stay Pending and the controller would keep writing
    ``readyReplicas: 0`` over what a test writes; kwok runs the Hugging Face one."""
    md["spec"]["model"]["source"] = {"huggingFace": "kvfleet/tiny-llama"}
    return md


def tiny_namespace(
    plane: ControlPlane, prefix: str, tenants: tuple[str, ...] = (), *, schedulable: bool = False
) -> Iterator[str]:
    """A fresh namespace with the CPU example ModelDeployment ``tiny`` and the named example tenants
    (``examples/local/tenant-<name>.yaml``); deleted afterwards. For a fixture to ``yield from``.

    ``schedulable``: the example's PVC model source swapped for a Hugging Face id (a download into an
    emptyDir cache), for a test that needs the workloads Ready on whichever tier the session's plane is.
    On the full tier the StatefulSet controller creates the engine pod, and no storage provisioner here
    binds the example's claim, so the pod would stay Pending; kwok runs the Hugging Face one."""
    with scratch_namespace(plane, prefix, crds=True) as namespace:
        md = load_example("local/modeldeployment-tiny.yaml", namespace)
        if schedulable:
            schedulable_on_kwok(md)
        create(plane, md)
        for name in tenants:
            create(plane, load_example(f"local/tenant-{name}.yaml", namespace))
        yield namespace
