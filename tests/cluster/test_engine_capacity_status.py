"""Planned vs reported KV capacity on the real API server: the status fields the CRD
stores, admission against the reported figure, ``CapacityBelowPlan``, and a converged resync with no
write.

The reconcile is the one every kopf handler calls, in process, with the operator's real engine reader.
The API tier runs no kubelet, so no engine answers here: an engine pod is created as the API server would
list it once Ready (its IP this machine's loopback, where nothing serves the metrics port). No StatefulSet
controls it, so the reader does not even ask it (``reconcile/capacity.owned_engine_pods``; asked, it would
answer nothing), and the figure an earlier reconcile recorded in ``status.kvCapacity`` is what
stands (the rule for "no engine readable now"). That figure is written the way the operator writes it
(server-side apply of the status, with its field manager). Reading a live engine's figure is proven on
the engine tier (``tests/engine/test_engine_capacity_live.py``).

The session's plane may already be the full tier (an earlier test extended it): then the StatefulSet
controller replaces the hand-made engine pod with its own, kwok runs it (a pod IP where nothing serves
either) and the controllers write the workloads' readiness themselves. The test reads a settled status in
both cases; its namespace's model source is one kwok can schedule (``tiny_namespace(schedulable=True)``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_helpers import wait_for
from devcluster import ControlPlane

from kvfleet_operator.api import ModelDeployment, reasons
from kvfleet_operator.build.common import PLUGIN_METRICS_PORT, selector_labels
from kvfleet_operator.build.tenant_table import compute_pool_capacity
from kvfleet_operator.handlers.reconcile import OperatorConfig
from kvfleet_operator.k8s import kinds
from kvfleet_operator.k8s.client import Credentials, KubeClient
from kvfleet_operator.k8s.engine_metrics import EngineCapacityReader
from operator_support import (
    API,
    CONFIG,
    condition,
    model_deployment,
    reconcile,
    tenant_table,
    tiny_namespace,
    workloads_ready,
)

MD = "tiny"


def _engine_pod(plane: ControlPlane, namespace: str) -> None:
    """An engine pod as the API server lists it once Ready, on an IP where nothing serves metrics."""
    labels = selector_labels(MD, "engine", "shared")
    # What the controller manager creates in every namespace (the API tier runs none).
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}
    status, body = plane.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", account)
    assert status in (201, 409), body
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{MD}-engine-0", "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "engine", "image": "kvfleet-engine:test"}]},
    }
    status, body = plane.request("POST", kinds.POD.path(namespace), pod)
    assert status == 201, body.get("message")
    ready = {
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "conditions": [{"type": "Ready", "status": "True"}],
        }
    }
    status, body = plane.request(
        "PATCH",
        kinds.POD.path(namespace, f"{MD}-engine-0") + "/status",
        ready,
        content_type="application/merge-patch+json",
    )
    assert status == 200, body


def _converge(plane: ControlPlane, namespace: str, config: OperatorConfig) -> None:
    """Reconcile, the workloads made ready first, until a round writes nothing."""
    for _ in range(6):
        workloads_ready(plane, namespace, MD)
        if reconcile(plane, namespace, MD, config)[1] == 0:
            return
    raise AssertionError(f"{namespace}/{MD} did not converge")


def _settled(plane: ControlPlane, namespace: str, config: OperatorConfig, degraded: str) -> dict[str, Any]:
    """Converge until ``Ready`` is True and ``Degraded`` is True with reason ``degraded``; the
    ModelDeployment then. When an earlier test extended the session's plane to the full tier, the
    StatefulSet and Deployment controllers write their own replica counts over the ones this test writes,
    and the workloads are ready only once kwok's pods run: the first rounds can read not ready."""

    def check() -> dict[str, Any] | None:
        _converge(plane, namespace, config)
        md = _md(plane, namespace)
        cause = condition(md, "Degraded")
        settled = (cause.get("status"), cause.get("reason")) == ("True", degraded)
        return md if settled and condition(md)["status"] == "True" else None

    found: dict[str, Any] = wait_for(check, timeout=90, interval=0.5, what=f"Ready=True, Degraded={degraded}")
    return found


def _md(plane: ControlPlane, namespace: str) -> dict[str, Any]:
    return model_deployment(plane, namespace, MD)


def _record_reported(plane: ControlPlane, namespace: str, blocks: int) -> None:
    """``status.kvCapacity.reportedBlocks`` as an earlier reconcile records it (the operator's manager)."""
    current = _md(plane, namespace)["status"]
    kv = {**current["kvCapacity"], "reportedBlocks": blocks}

    async def go() -> None:
        async with KubeClient(Credentials.from_kubeconfig(plane.kubeconfig)) as client:
            await client.apply_status(kinds.MODEL_DEPLOYMENT, MD, namespace, {**current, "kvCapacity": kv})

    asyncio.run(go())


@pytest.fixture
def namespace(api_cluster: ControlPlane) -> Iterator[str]:
    yield from tiny_namespace(api_cluster, "capacity", ("basic-a",), schedulable=True)


def test_reported_capacity_drives_admission_and_status(api_cluster: ControlPlane, namespace: str) -> None:
    plane = api_cluster
    with socket.socket() as probe:  # nothing may answer on the loopback metrics port for this test
        assert probe.connect_ex(("127.0.0.1", PLUGIN_METRICS_PORT)) != 0, "something serves :8001 here"
    config = dataclasses.replace(
        CONFIG, watch_namespaces=(namespace,), engine_capacity=EngineCapacityReader(timeout_s=1)
    )
    planned = compute_pool_capacity(ModelDeployment.model_validate(_md(plane, namespace))).hbm_blocks

    # Before any engine reports: the estimate, in status and in the tenant table.
    _engine_pod(plane, namespace)
    _converge(plane, namespace, config)
    kv = _md(plane, namespace)["status"]["kvCapacity"]
    assert kv["plannedBlocks"] == planned and "reportedBlocks" not in kv
    assert kv["perReplica"]["hbm"]["blocks"] == planned
    table = tenant_table(plane, namespace, MD)
    assert table.pools["shared"].hbm_blocks_per_replica == planned
    assert table.tenants["basic-a"].quota.hbm_blocks == planned // 10  # 10%

    # The engines reported fewer blocks than planned (recorded by an earlier reconcile; none readable now).
    reported = planned * 3 // 4
    _record_reported(plane, namespace, reported)
    md = _settled(plane, namespace, config, reasons.CAPACITY_BELOW_PLAN)  # still serving
    kv = md["status"]["kvCapacity"]
    assert (kv["plannedBlocks"], kv["reportedBlocks"]) == (planned, reported)
    assert kv["perReplica"]["hbm"]["blocks"] == reported
    degraded = condition(md, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", reasons.CAPACITY_BELOW_PLAN)
    assert f"vLLM allocated {reported} KV blocks per replica" in degraded["message"]
    assert "cpuKvCacheSpace" in degraded["message"]  # a CPU engine: no reserve to raise
    assert condition(md, "Ready")["status"] == "True", condition(md, "Ready")
    table = tenant_table(plane, namespace, MD)
    assert table.pools["shared"].hbm_blocks_per_replica == reported
    assert table.tenants["basic-a"].quota.hbm_blocks == reported // 10  # admitted against the engines' figure
    # Converged: a resync applies nothing and soon writes nothing (the reader does not ask the pod again
    # within its retry time; were a figure rewritten on every round, this would never converge). On the
    # full tier a round may still rightly write status once, when the controllers move the workloads.
    assert reconcile(plane, namespace, MD, config)[0].applied == []
    _converge(plane, namespace, config)

    # A spec change that moves the estimate drops the old figure until an engine reports again.
    md["spec"]["pool"]["cpuKvCacheSpace"] = "2Gi"
    status, body = plane.request("PUT", f"{API}/namespaces/{namespace}/modeldeployments/{MD}", md)
    assert status == 200, body
    _converge(plane, namespace, config)
    md = _md(plane, namespace)
    kv = md["status"]["kvCapacity"]
    assert kv["plannedBlocks"] == 2 * planned and "reportedBlocks" not in kv
    assert condition(md, "Degraded").get("reason") != reasons.CAPACITY_BELOW_PLAN
