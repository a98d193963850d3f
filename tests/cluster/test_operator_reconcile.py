"""The operator's reconcile against the real API server, scheduler and kwok GPU nodes.

These tests call the same ``reconcile_model_deployment`` every kopf handler calls, in process, so they
can count API calls; ``test_operator_process.py`` runs the real operator process.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import apply_crds, create_namespace, delete_namespace, wait_for
from devcluster import ControlPlane
from devcluster.shared_store import start_shared_store

from components import missing_component
from kvfleet_operator.build.gateway_store import GatewayStore, parse_gateway_store
from kvfleet_operator.build.model_deployment import OperatorImages
from kvfleet_operator.handlers.reconcile import OperatorConfig, load_gateway_store, reconcile_model_deployment
from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.client import Credentials, KubeClient
from kvfleet_operator.k8s.gateway_store import GatewayStoreProbe
from kvfleet_runtime.config import KeyFile, TenantTable, derive_cache_salt, hash_api_key
from operator_support import bind_namespace_groups

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CONFIG = OperatorConfig(
    images=OperatorImages(engine="kvfleet-engine:test", gateway="kvfleet:test"), salt_master=b"m" * 32
)
BANK_KEY = "kvf-bank-test-key-0123456789abcdef"


def load_example(name: str, namespace: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"]["namespace"] = namespace
    return doc


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _with_client(plane: ControlPlane, fn: Any) -> Any:
    async with KubeClient(Credentials.from_kubeconfig(plane.kubeconfig)) as client:
        return await fn(client)


def reconcile(
    plane: ControlPlane, namespace: str, name: str, config: OperatorConfig = CONFIG
) -> tuple[Any, int]:
    """One reconcile; returns its result and the number of mutating API calls it made.

    The operator watches ``namespace`` only (unless ``config`` says otherwise): dedicated GPU groups are
    owned across the watched namespaces, and other tests' tenants may still be going away elsewhere."""
    config = dataclasses.replace(config, watch_namespaces=config.watch_namespaces or (namespace,))
    config = bind_namespace_groups(plane, namespace, config)  # as the platform would for this team

    async def go(client: KubeClient) -> tuple[Any, int]:
        result = await reconcile_model_deployment(client, config, namespace, name)
        return result, client.mutating_calls

    out: tuple[Any, int] = run(_with_client(plane, go))
    return out


def create(plane: ControlPlane, doc: dict[str, Any]) -> None:
    namespace = doc["metadata"].get("namespace")
    path = {
        "ModelDeployment": f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/modeldeployments",
        "Tenant": f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenants",
        "Secret": f"/api/v1/namespaces/{namespace}/secrets",
        "PersistentVolume": "/api/v1/persistentvolumes",
    }[doc["kind"]]
    status, body = plane.request("POST", path, doc)
    assert status == 201, body


def get(plane: ControlPlane, path: str) -> dict[str, Any]:
    status, body = plane.request("GET", path)
    assert status == 200, (path, body)
    result: dict[str, Any] = body
    return result


def condition(obj: dict[str, Any], kind: str = "Ready") -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            result: dict[str, Any] = cond
            return result
    return {}


def tenant(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    return get(plane, f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenants/{name}")


def owned_children(plane: ControlPlane, namespace: str, md: str) -> set[tuple[str, str]]:
    selector = f"app.kubernetes.io/managed-by=kvfleet-operator,kvfleet.io/model-deployment={md}"
    found: set[tuple[str, str]] = set()
    for kind in kinds.CHILD_KINDS:
        if kind in (*kinds.MONITORING_KINDS, *kinds.EXPOSURE_KINDS):  # optional APIs (none is asked here)
            continue
        body = get(plane, f"{kind.path(namespace)}?labelSelector={selector}")
        found |= {(kind.kind, item["metadata"]["name"]) for item in body["items"]}
    return found


def provision_local_nvme(plane: ControlPlane, namespace: str, per_node: int = 2) -> None:
    """What a platform team provides for `storageClassName: local-nvme`: static local PVs per GPU node.

    Nothing here recycles a released PV (a real local provisioner wipes and re-offers it): a test that
    deletes engine StatefulSets, whose claims go with them, needs more than ``per_node`` 2."""
    sc = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": "local-nvme"},
        "provisioner": "kubernetes.io/no-provisioner",
        "volumeBindingMode": "WaitForFirstConsumer",
    }
    plane.request("POST", "/apis/storage.k8s.io/v1/storageclasses", sc)
    for node in plane.layout.nodes:
        for i in range(per_node):
            create(
                plane,
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolume",
                    "metadata": {"name": f"nvme-{namespace}-{node.name}-{i}"},
                    "spec": {
                        "capacity": {"storage": "2Ti"},
                        "accessModes": ["ReadWriteOnce"],
                        "storageClassName": "local-nvme",
                        "persistentVolumeReclaimPolicy": "Delete",
                        "local": {"path": f"/mnt/nvme{i}"},
                        "nodeAffinity": {
                            "required": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {
                                                "key": "kubernetes.io/hostname",
                                                "operator": "In",
                                                "values": [node.name],
                                            }
                                        ]
                                    }
                                ]
                            }
                        },
                    },
                },
            )


@pytest.fixture(scope="module")
def examples_ns(full_cluster: ControlPlane) -> Iterator[str]:
    """The examples applied to a fresh namespace that enforces the `restricted` Pod Security level."""
    apply_crds(full_cluster)
    namespace = create_namespace(
        full_cluster, "llm", labels={"pod-security.kubernetes.io/enforce": "restricted"}
    )
    provision_local_nvme(full_cluster, namespace)
    create(
        full_cluster,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": "bank-api-key",
                "namespace": namespace,
                "labels": {"kvfleet.io/tenant": "bank"},
            },
            "data": {"api-key": base64.b64encode(BANK_KEY.encode()).decode()},
        },
    )
    create(full_cluster, load_example("modeldeployment-qwen72b.yaml", namespace))
    for name in ("tenant-bank.yaml", "tenant-saas.yaml", "tenant-startup-a.yaml", "tenant-startup-b.yaml"):
        create(full_cluster, load_example(name, namespace))
    yield namespace
    delete_namespace(full_cluster, namespace)


def _converge(plane: ControlPlane, namespace: str, md: str = "qwen72b", rounds: int = 6) -> int:
    """Reconcile until a round mutates nothing; returns the rounds it took."""
    for i in range(1, rounds + 1):
        _, mutations = reconcile(plane, namespace, md)
        if mutations == 0:
            return i
    raise AssertionError(f"{md} did not converge in {rounds} reconciles")


def test_examples_create_exactly_the_expected_objects(full_cluster: ControlPlane, examples_ns: str) -> None:
    result, mutations = reconcile(full_cluster, examples_ns, "qwen72b")
    assert mutations > 0 and not result.problem
    expected = {
        ("ConfigMap", "qwen72b-tenants"),
        ("Secret", "qwen72b-keys"),
        ("Deployment", "qwen72b-gateway"),
        ("Service", "qwen72b-gateway"),
        ("Service", "qwen72b-gateway-metrics"),
        ("PodDisruptionBudget", "qwen72b-gateway"),
        ("NetworkPolicy", "qwen72b-gateway"),
    }
    for pool in ("engine", "dedicated-bank-engine"):
        expected |= {
            ("StatefulSet", f"qwen72b-{pool}"),
            ("Service", f"qwen72b-{pool}"),
            ("PodDisruptionBudget", f"qwen72b-{pool}"),
            ("NetworkPolicy", f"qwen72b-{pool}"),
        }
    assert owned_children(full_cluster, examples_ns, "qwen72b") == expected

    # The runtime config, as data: every tenant admitted, salts as the isolation levels say.
    cm = get(full_cluster, f"/api/v1/namespaces/{examples_ns}/configmaps/qwen72b-tenants")
    table = TenantTable.model_validate_json(cm["data"]["tenants.json"])
    assert set(table.tenants) == {"bank", "saas", "startup-a", "startup-b"}
    assert table.tenants["bank"].pool == "dedicated-bank"
    assert table.pools["dedicated-bank"].dedicated_to == "bank"
    assert table.tenants["startup-a"].salt_id == table.tenants["startup-b"].salt_id == table.pool_salt_id
    assert table.tenants["saas"].salt_id != table.pool_salt_id
    assert table.pools["shared"].engine is not None
    assert table.pools["shared"].engine.kv_cache_dtype == "fp8_e5m2"

    # Keys: hashes only; the bank's referenced key, generated keys for the others.
    secret = get(full_cluster, f"/api/v1/namespaces/{examples_ns}/secrets/qwen72b-keys")
    keys = KeyFile.model_validate_json(base64.b64decode(secret["data"]["keys.json"]))
    assert keys.key_hashes["bank"] == [hash_api_key(BANK_KEY)]
    assert BANK_KEY not in json.dumps(secret)
    generated = get(full_cluster, f"/api/v1/namespaces/{examples_ns}/secrets/saas-api-key")
    saas_key = base64.b64decode(generated["data"]["api-key"]).decode()
    assert len(saas_key) >= 43 and keys.key_hashes["saas"] == [hash_api_key(saas_key)]
    assert derive_cache_salt(keys.salt_key, table.tenants["saas"].salt_id) != derive_cache_salt(
        keys.salt_key, table.pool_salt_id
    )


#: The example's tenants: bank on its dedicated pool, the others on the shared one.
ALL_EXAMPLE_TENANTS = ("bank", "saas", "startup-a", "startup-b")


def _readiness_report(plane: ControlPlane, namespace: str) -> str:
    lines = [f"{name} Ready: {condition(tenant(plane, namespace, name))}" for name in ALL_EXAMPLE_TENANTS]
    for resource in ("statefulsets", "deployments"):
        for obj in get(plane, f"/apis/apps/v1/namespaces/{namespace}/{resource}")["items"]:
            lines.append(f"{resource} {obj['metadata']['name']}: {obj.get('status')}")
    for pod in get(plane, f"/api/v1/namespaces/{namespace}/pods")["items"]:
        status = pod.get("status") or {}
        conditions = [(c["type"], c["status"]) for c in status.get("conditions") or []]
        where = pod["spec"].get("nodeName")
        lines.append(f"Pod {pod['metadata']['name']} on {where}: {status.get('phase')} {conditions}")
    for node in get(plane, "/api/v1/nodes")["items"]:
        ready = condition(node)
        since = ready.get("lastTransitionTime")
        lines.append(f"Node {node['metadata']['name']}: Ready={ready.get('status')} since {since}")
    return "\n".join(lines)


def test_engine_pods_land_on_the_right_gpu_nodes(full_cluster: ControlPlane, examples_ns: str) -> None:
    _converge(full_cluster, examples_ns)
    shared_nodes = {n.name for n in full_cluster.layout.shared_pool}
    bank_nodes = {n.name for n in full_cluster.layout.dedicated_groups["bank-h200"]}

    def placed() -> dict[str, str] | None:
        pods = get(full_cluster, f"/api/v1/namespaces/{examples_ns}/pods")["items"]
        engines = {
            p["metadata"]["name"]: p["spec"].get("nodeName", "")
            for p in pods
            if p["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"
        }
        return engines if len(engines) == 3 and all(engines.values()) else None

    engines = wait_for(placed, timeout=90, what="3 engine pods scheduled")
    assert {engines["qwen72b-engine-0"], engines["qwen72b-engine-1"]} <= shared_nodes
    assert engines["qwen72b-dedicated-bank-engine-0"] in bank_nodes

    # The scheduler saw the GPU requests: each shared replica takes a whole 8-GPU node.
    assert engines["qwen72b-engine-0"] != engines["qwen72b-engine-1"]

    # Each pool gets Ready on its own: the dedicated one (bank) may be ahead of the shared one.
    def all_ready() -> bool:
        _converge(full_cluster, examples_ns)
        return all(
            condition(tenant(full_cluster, examples_ns, name)).get("status") == "True"
            for name in ALL_EXAMPLE_TENANTS
        )

    try:
        wait_for(all_ready, timeout=120, interval=2, what="every tenant Ready")
    except AssertionError as exc:  # say why: the conditions, the workloads' and the pods' status
        raise AssertionError(f"{exc}\n{_readiness_report(full_cluster, examples_ns)}") from None
    md = get(full_cluster, f"/apis/kvfleet.io/v1alpha1/namespaces/{examples_ns}/modeldeployments/qwen72b")
    assert condition(md)["status"] == "True"
    assert md["status"]["kvCapacity"]["perReplica"]["hbm"]["tokens"] > 0
    assert md["status"]["guaranteed"]["tenants"] == 4


def test_the_shared_stores_secrets_are_read_at_start_up_and_a_missing_one_is_named(
    full_cluster: ControlPlane, examples_ns: str
) -> None:
    """What the operator does at start-up with the chart's gatewaySharedStore, against the real API server:
    a Secret that is not there stops it with a message naming the Secret and the chart value (kopf retries
    the start-up, so creating the Secret is the fix); once there, the password and CA are read."""
    ref = parse_gateway_store(
        json.dumps(
            {
                "url": "rediss://store.platform.svc:6380",
                "namespace": examples_ns,
                "passwordSecret": {"name": "gateway-store", "key": "password"},
                "caSecret": {"name": "gateway-store", "key": "ca.crt"},
            }
        )
    )
    with pytest.raises(
        ValueError, match=f"gatewaySharedStore.passwordSecret: Secret {examples_ns}/gateway-store"
    ):
        run(_with_client(full_cluster, lambda client: load_gateway_store(client, ref)))
    data = {"password": "cGFzc3dvcmQtMDEyMzQ1Njc4OWFiY2RlZg==", "ca.crt": "LS0tLS1CRUdJTg=="}
    doc = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "gateway-store", "namespace": examples_ns},
    }
    create(full_cluster, {**doc, "data": {"ca.crt": data["ca.crt"]}})
    with pytest.raises(ValueError, match=r"has no data key 'password' \(it has \['ca.crt'\]\)"):
        run(_with_client(full_cluster, lambda client: load_gateway_store(client, ref)))
    full_cluster.request(
        "PATCH",
        f"/api/v1/namespaces/{examples_ns}/secrets/gateway-store",
        {"data": {"password": data["password"]}},
        content_type="application/merge-patch+json",
    )
    store = run(_with_client(full_cluster, lambda client: load_gateway_store(client, ref)))
    assert store == GatewayStore(
        "rediss://store.platform.svc:6380", "password-0123456789abcdef", "-----BEGIN"
    )


def test_a_shared_store_that_does_not_answer_degrades_the_model_deployment(
    full_cluster: ControlPlane,
) -> None:
    """``SharedStoreUnreachable``: the operator asks the gateways' shared store (a real ``redis-server``
    with a password) whether it answers, and says on the ModelDeployment when it does not (``Degraded``,
    still serving: the gateways fall back to their static shares); a wrong password is the same condition,
    and the condition goes when the store answers again. A namespace of its own: the condition is this
    test's alone."""
    try:
        server = start_shared_store()
    except FileNotFoundError as exc:
        missing_component(f"redis-server ({exc})", "bash hack/provision.d/10-cluster.sh")
    namespace = create_namespace(full_cluster, "store")
    try:
        apply_crds(full_cluster)
        create(full_cluster, load_example("modeldeployment-qwen72b.yaml", namespace))
        path = f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/modeldeployments/qwen72b"

        def degraded(store: GatewayStore) -> dict[str, Any]:
            probe = GatewayStoreProbe(store, ttl_s=0, timeout_s=0.5)
            config = dataclasses.replace(CONFIG, gateway_store=store, gateway_store_probe=probe)
            reconcile(full_cluster, namespace, "qwen72b", config)
            return condition(get(full_cluster, path), "Degraded")

        good = GatewayStore(server.url, server.password)
        assert degraded(good).get("reason") != "SharedStoreUnreachable"
        wrong = degraded(dataclasses.replace(good, password="not-the-password-0123456789"))
        assert (wrong.get("status"), wrong.get("reason")) == ("True", "SharedStoreUnreachable"), wrong
        server.kill()
        down = degraded(good)
        assert (down.get("status"), down.get("reason")) == ("True", "SharedStoreUnreachable"), down
        assert f"127.0.0.1:{server.port}" in down["message"] and server.password not in down["message"]
        server.start()
        assert degraded(good).get("reason") != "SharedStoreUnreachable"
    finally:
        server.stop()
        delete_namespace(full_cluster, namespace)


def test_second_reconcile_of_converged_object_mutates_nothing(
    full_cluster: ControlPlane, examples_ns: str
) -> None:
    _converge(full_cluster, examples_ns)
    _, mutations = reconcile(full_cluster, examples_ns, "qwen72b")
    assert mutations == 0


def test_overcommitting_tenant_is_rejected_with_numbers_and_nothing_applied(
    full_cluster: ControlPlane, examples_ns: str
) -> None:
    doc = load_example("tenant-saas.yaml", examples_ns)
    doc["metadata"]["name"] = "greedy"
    doc["spec"]["kvQuota"] = {"hbm": "70%"}
    doc["spec"]["burstLimit"] = "80%"
    create(full_cluster, doc)
    before = owned_children(full_cluster, examples_ns, "qwen72b")
    _converge(full_cluster, examples_ns)
    ready = condition(tenant(full_cluster, examples_ns, "greedy"))
    assert ready["status"] == "False" and ready["reason"] == "QuotaExceedsCapacity"
    assert "blocks per replica" in ready["message"]
    assert owned_children(full_cluster, examples_ns, "qwen72b") == before
    assert full_cluster.request("GET", f"/api/v1/namespaces/{examples_ns}/secrets/greedy-api-key")[0] == 404
    cm = get(full_cluster, f"/api/v1/namespaces/{examples_ns}/configmaps/qwen72b-tenants")
    assert "greedy" not in TenantTable.model_validate_json(cm["data"]["tenants.json"]).tenants
    # What `kubectl describe tn greedy` shows under Events.
    events = get(full_cluster, f"/api/v1/namespaces/{examples_ns}/events")["items"]
    mine = [e for e in events if e["involvedObject"]["name"] == "greedy"]
    assert [(e["type"], e["reason"]) for e in mine] == [("Warning", "QuotaExceedsCapacity")]


def test_missing_secret_and_dangling_reference_say_what_to_do(
    full_cluster: ControlPlane, examples_ns: str
) -> None:
    nokey = load_example("tenant-saas.yaml", examples_ns)
    nokey["metadata"]["name"] = "nokey"
    nokey["spec"]["kvQuota"] = {"hbm": "1%"}
    nokey["spec"]["apiKeySecretRef"] = {"name": "does-not-exist"}
    create(full_cluster, nokey)
    ghost = load_example("tenant-startup-a.yaml", examples_ns)
    ghost["metadata"]["name"] = "ghost-user"
    ghost["spec"]["modelDeploymentRef"] = {"name": "ghost"}
    create(full_cluster, ghost)
    _converge(full_cluster, examples_ns)
    reconcile(full_cluster, examples_ns, "ghost")

    nokey_ready = condition(tenant(full_cluster, examples_ns, "nokey"))
    assert nokey_ready["reason"] == "ApiKeySecretNotFound"
    assert "does-not-exist" in nokey_ready["message"] and "spec.apiKeySecretRef" in nokey_ready["message"]
    ghost_ready = condition(tenant(full_cluster, examples_ns, "ghost-user"))
    assert ghost_ready["reason"] == "ModelDeploymentNotFound"
    assert "spec.modelDeploymentRef.name" in ghost_ready["message"]
    cm = get(full_cluster, f"/api/v1/namespaces/{examples_ns}/configmaps/qwen72b-tenants")
    assert "nokey" not in TenantTable.model_validate_json(cm["data"]["tenants.json"]).tenants


def _monitoring_crd(plural: str, kind: str) -> dict[str, Any]:
    """A minimal stand-in for the Prometheus Operator's CRD (its real schema is not available offline;
    the operator only needs the API to be served)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "names": {"plural": plural, "kind": kind, "singular": kind.lower(), "listKind": f"{kind}List"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }


def test_monitors_are_created_only_when_the_monitoring_api_exists(
    full_cluster: ControlPlane, examples_ns: str
) -> None:
    crds = [
        _monitoring_crd("servicemonitors", "ServiceMonitor"),
        _monitoring_crd("podmonitors", "PodMonitor"),
    ]
    for crd in crds:
        status, body = full_cluster.request(
            "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd
        )
        assert status == 201, body
    try:

        async def served(client: KubeClient) -> bool:
            return await client.api_group_exists("monitoring.coreos.com/v1")

        wait_for(lambda: run(_with_client(full_cluster, served)), timeout=30, what="monitoring API served")
        for plural in ("servicemonitors", "podmonitors"):  # a new CRD's storage answers 429 for a moment
            path = f"/apis/monitoring.coreos.com/v1/namespaces/{examples_ns}/{plural}"
            wait_for(lambda path=path: full_cluster.request("GET", path)[0] == 200, timeout=30, what=path)
        with_monitoring = dataclasses.replace(CONFIG, monitoring=True)
        for _ in range(3):
            reconcile(full_cluster, examples_ns, "qwen72b", with_monitoring)
        sm = get(full_cluster, f"/apis/monitoring.coreos.com/v1/namespaces/{examples_ns}/servicemonitors")
        pm = get(full_cluster, f"/apis/monitoring.coreos.com/v1/namespaces/{examples_ns}/podmonitors")
        assert [i["metadata"]["name"] for i in sm["items"]] == ["qwen72b-gateway"]
        assert [i["metadata"]["name"] for i in pm["items"]] == ["qwen72b-engines"]
        endpoints = pm["items"][0]["spec"]["podMetricsEndpoints"]
        assert {e["port"] for e in endpoints} == {"metrics"}  # the one metrics port, never vLLM's
    finally:
        for crd in crds:
            full_cluster.request(
                "DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
            )
