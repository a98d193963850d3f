"""The real operator process (``kvfleet operator``) against the real control plane: drift repair,
kill-and-restart convergence, deletion semantics."""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import apply_crds, create_namespace, delete_namespace, wait_for
from devcluster import ControlPlane
from test_operator_reconcile import (
    CONFIG,
    condition,
    create,
    get,
    load_example,
    owned_children,
    provision_local_nvme,
    reconcile,
    tenant,
)

from factories import free_port
from kvfleet_operator.build.gateway_store import PASSWORD_DATA_KEY, GatewayStore
from kvfleet_operator.k8s.gateway_store import GatewayStoreProbe
from kvfleet_runtime.config import TenantTable

#: The gateways' shared store the operator process is given, and the Secret holding its password. Nothing
#: listens on port 1: the operator's probe gets the same refusal every time (``SharedStoreUnreachable``).
STORE = GatewayStore("redis://127.0.0.1:1/0", password="store-password-0123456789abcdef")
STORE_SECRET = {"name": "gateway-store", "key": "password"}


class OperatorProcess:
    """``kvfleet operator`` in its own process group, watching one namespace."""

    def __init__(self, plane: ControlPlane, namespace: str, log_dir: Path) -> None:
        self.plane, self.namespace, self.log_dir = plane, namespace, log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = (self.log_dir / f"operator-{self.starts}.log").open("wb")
        env = {
            **self.plane.env(),
            "KVFLEET_RESYNC_SECONDS": "5",
            # One pod restarted in place: the same identity, so a restart takes its own Lease back at once.
            "POD_NAME": "operator-0",
            "KVFLEET_SALT_SECRET": f"{self.namespace}/kvfleet-salt-master",
            # The same images as the in-process CONFIG, so both render identical objects.
            "KVFLEET_ENGINE_IMAGE": CONFIG.images.engine,
            "KVFLEET_GATEWAY_IMAGE": CONFIG.images.gateway,
            # The chart's gatewaySharedStore, its password in a Secret of the operator's namespace.
            "KVFLEET_GATEWAY_SHARED_STORE": json.dumps(
                {"url": STORE.url, "namespace": self.namespace, "passwordSecret": STORE_SECRET}
            ),
            "PYTHONUNBUFFERED": "1",
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvfleet_runtime",
                "operator",
                "--namespace",
                self.namespace,
                "--metrics-port",
                "0",
                "--probe-address",
                f"127.0.0.1:{free_port()}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


@pytest.fixture(scope="module")
def running(
    full_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Any]]:
    apply_crds(full_cluster)
    namespace = create_namespace(
        full_cluster, "op", labels={"pod-security.kubernetes.io/enforce": "restricted"}
    )
    # The drift test deletes the engine StatefulSet, and its volume claims go with it: enough local PVs.
    provision_local_nvme(full_cluster, namespace, per_node=16)
    create(full_cluster, load_example("modeldeployment-qwen72b.yaml", namespace))
    for name in ("tenant-saas.yaml", "tenant-startup-a.yaml", "tenant-startup-b.yaml"):
        create(full_cluster, load_example(name, namespace))
    assert STORE.password is not None
    create(
        full_cluster,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": STORE_SECRET["name"], "namespace": namespace},
            "data": {STORE_SECRET["key"]: _b64(STORE.password)},
        },
    )
    operator = OperatorProcess(full_cluster, namespace, tmp_path_factory.mktemp("operator"))
    operator.start()
    wait_for(
        lambda: condition(tenant(full_cluster, namespace, "saas")).get("status") == "True",
        timeout=120,
        interval=1,
        what="tenant saas Ready through the operator process",
    )
    yield namespace, operator
    operator.stop()
    delete_namespace(full_cluster, namespace)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# (kind path segment, name, merge patch that breaks it, getter of the field the patch breaks)
def _injections(ns: str) -> list[tuple[str, str, dict[str, Any], Any]]:
    return [
        (f"/api/v1/namespaces/{ns}/configmaps", "qwen72b-tenants", {"data": {"tenants.json": "{}"}},
         lambda o: o["data"]["tenants.json"]),
        (f"/api/v1/namespaces/{ns}/secrets", "qwen72b-keys", {"data": {"keys.json": _b64("{}")}},
         lambda o: o["data"]["keys.json"]),
        (f"/apis/apps/v1/namespaces/{ns}/deployments", "qwen72b-gateway", {"spec": {"replicas": 7}},
         lambda o: o["spec"]["replicas"]),
        (f"/apis/apps/v1/namespaces/{ns}/statefulsets", "qwen72b-engine", {"spec": {"replicas": 1}},
         lambda o: o["spec"]["replicas"]),
        (f"/api/v1/namespaces/{ns}/services", "qwen72b-gateway", {"spec": {"type": "NodePort"}},
         lambda o: o["spec"]["type"]),
        (f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies", "qwen72b-engine",
         {"spec": {"ingress": []}}, lambda o: o["spec"].get("ingress")),
        (f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", "qwen72b-gateway",
         {"spec": {"maxUnavailable": 5}}, lambda o: o["spec"]["maxUnavailable"]),
    ]  # fmt: skip


def _restored(plane: ControlPlane, path: str, old_uid: str | None, field: Any, want: Any) -> bool:
    """The child exists again (a new object, when it was deleted) with the broken field put back."""
    status, obj = plane.request("GET", path)
    if status != 200 or obj["metadata"].get("deletionTimestamp"):
        return False
    if old_uid is not None and obj["metadata"]["uid"] == old_uid:
        return False
    return bool(field(obj) == want)


def test_drift_is_repaired_within_ten_seconds(full_cluster: ControlPlane, running: tuple[str, Any]) -> None:
    namespace, _ = running
    rng = random.Random(7)
    injections = _injections(namespace)
    durations: list[float] = []
    for _ in range(50):
        base, name, patch, field = rng.choice(injections)
        path = f"{base}/{name}"
        before = get(full_cluster, path)
        want = field(before)
        deleted = rng.random() < 0.5
        if deleted:
            status, body = full_cluster.request("DELETE", path)
        else:
            status, body = full_cluster.request(
                "PATCH", path, patch, content_type="application/merge-patch+json"
            )
        assert status == 200, body
        started = time.monotonic()
        old_uid = before["metadata"]["uid"] if deleted else None
        wait_for(
            functools.partial(_restored, full_cluster, path, old_uid, field, want),
            timeout=30,
            interval=0.1,
            what=f"{name} repaired",
        )
        durations.append(time.monotonic() - started)
    durations.sort()
    p99 = durations[int(0.99 * (len(durations) - 1))]
    print(
        f"drift repair over {len(durations)} injections: median {statistics.median(durations):.2f} s, "
        f"p99 {p99:.2f} s, max {durations[-1]:.2f} s"
    )
    assert p99 <= 10.0


def test_the_gateways_get_the_shared_store_with_its_password_copied_into_the_keys_secret(
    full_cluster: ControlPlane, running: tuple[str, Any]
) -> None:
    """The operator read the platform's Secret at start-up and rendered the store for the gateway: the URL
    as a flag, the password in the ModelDeployment's keys Secret (which the gateway pods mount) and, from
    there, in the gateway's environment, never on its command line."""
    namespace, _ = running
    deployment = get(full_cluster, f"/apis/apps/v1/namespaces/{namespace}/deployments/qwen72b-gateway")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[command.index("--shared-store") + 1] == STORE.url
    assert STORE.password is not None and STORE.password not in json.dumps(deployment)
    assert container["env"] == [
        {
            "name": "KVFLEET_SHARED_STORE_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "qwen72b-keys", "key": PASSWORD_DATA_KEY}},
        }
    ]
    keys = get(full_cluster, f"/api/v1/namespaces/{namespace}/secrets/qwen72b-keys")
    assert base64.b64decode(keys["data"][PASSWORD_DATA_KEY]).decode() == STORE.password
    # The operator asked that store (nothing answers): still serving, degraded, the reason says why.
    md = get(full_cluster, f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/modeldeployments/qwen72b")
    degraded = condition(md, "Degraded")
    assert (degraded.get("status"), degraded.get("reason")) == ("True", "SharedStoreUnreachable"), degraded
    assert "127.0.0.1:1" in degraded["message"] and STORE.password not in json.dumps(md)


def test_killing_the_operator_mid_reconcile_always_converges(
    full_cluster: ControlPlane, running: tuple[str, Any]
) -> None:
    namespace, operator = running
    rng = random.Random(11)
    for i in range(20):
        doc = load_example("tenant-startup-a.yaml", namespace)
        doc["metadata"]["name"] = f"churn-{i}"
        doc["spec"]["kvQuota"] = {"hbm": "1%"}
        create(full_cluster, doc)
        time.sleep(rng.uniform(0.0, 1.5))
        operator.kill()
        operator.start()

        def converged(name: str = f"churn-{i}") -> bool:
            cm = get(full_cluster, f"/api/v1/namespaces/{namespace}/configmaps/qwen72b-tenants")
            table = TenantTable.model_validate_json(cm["data"]["tenants.json"])
            return (
                name in table.tenants
                and condition(tenant(full_cluster, namespace, name)).get("status") == "True"
            )

        wait_for(converged, timeout=60, interval=0.5, what=f"churn-{i} admitted after a restart")
    # Everything converged: an extra reconcile (with the operator's own master key and store) has nothing
    # left to do, and nothing is orphaned.
    master = get(full_cluster, f"/api/v1/namespaces/{namespace}/secrets/kvfleet-salt-master")
    config = dataclasses.replace(
        CONFIG,
        salt_master=base64.b64decode(master["data"]["master-key"]),
        gateway_store=STORE,
        gateway_store_probe=GatewayStoreProbe(STORE),
    )
    _, mutations = reconcile(full_cluster, namespace, "qwen72b", config)
    assert mutations == 0
    children = owned_children(full_cluster, namespace, "qwen72b")
    assert len(children) == 11  # shared pool (4) + gateway (5) + config (2): no duplicates or leftovers


def test_deleting_a_model_deployment_with_tenants_is_held_until_they_go(
    full_cluster: ControlPlane, running: tuple[str, Any]
) -> None:
    namespace, _ = running
    md_path = f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/modeldeployments/qwen72b"
    status, body = full_cluster.request("DELETE", md_path)
    assert status == 200, body
    wait_for(
        lambda: condition(tenant(full_cluster, namespace, "saas")).get("reason") == "ModelDeploymentDeleting",
        timeout=60,
        interval=0.5,
        what="tenants told that their ModelDeployment waits for them",
    )
    assert full_cluster.request("GET", md_path)[0] == 200  # held by the finalizer
    tenants = get(full_cluster, f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenants")["items"]
    for item in tenants:
        full_cluster.request(
            "DELETE", f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenants/{item['metadata']['name']}"
        )
    wait_for(
        lambda: full_cluster.request("GET", md_path)[0] == 404,
        timeout=60,
        interval=0.5,
        what="ModelDeployment gone once its tenants are (no stuck finalizer)",
    )
