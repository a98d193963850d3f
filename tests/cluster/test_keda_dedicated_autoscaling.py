"""KEDA scales a dedicated tenant's pool within its GPU group's nodes, through the real chain.

The same chain as :mod:`test_keda_autoscaling` (the gateway's queue gauge → Prometheus → KEDA's operator and
metrics API server → the HPA in kube-controller-manager), with a Tenant as the target: the operator renders
one ScaledObject for the autoscaled dedicated tenant (``spec.dedicated.autoscaling``), owned by the Tenant,
whose HPA writes ``spec.dedicated.replicas`` through the Tenant's scale subresource; the reconcile turns it
into the dedicated engine StatefulSet. The devcluster's kwok layout gives the group ``bank-h200`` two
8-GPU nodes, and qwen72b's replica takes 8 GPUs (and 288Gi of memory): the group holds two replicas, so
the ScaledObject's maximum is two whatever maxReplicas says, and the StatefulSet never runs more.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import pytest
from cluster_helpers import apply_crds, scratch_namespace, wait_for
from devcluster import ControlPlane, PrometheusServer
from devcluster.keda import Keda
from test_keda_autoscaling import (  # noqa: F401 - gateway_metrics is a fixture
    KEDA_RIGHTS,
    STEP_S,
    gateway_metrics,
    scrape_config,
)
from test_operator_reconcile import BANK_KEY, create, get, load_example, reconcile

from kvfleet_runtime.gateway.metrics import GatewayMetrics

pytestmark = pytest.mark.cluster

MD = "qwen72b"
TENANT = "bank"
GROUP = "bank-h200"
POOL = f"dedicated-{TENANT}"
API = "/apis/kvfleet.io/v1alpha1"
#: Queued premium requests per replica the pool is sized for (the ModelDeployment's signal).
PREMIUM_PER_REPLICA = 4
MAX_REPLICAS = 4


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), {})


def _cordon(plane: ControlPlane, node: str, cordoned: bool) -> None:
    status, body = plane.request(
        "PATCH",
        f"/api/v1/nodes/{node}",
        {"spec": {"unschedulable": cordoned or None}},
        content_type="application/merge-patch+json",
    )
    assert status == 200, body


def test_a_queue_step_scales_a_dedicated_pool_through_keda_within_its_gpu_groups_nodes(
    full_cluster: ControlPlane,
    keda: Keda,
    prometheus: Callable[..., PrometheusServer],
    gateway_metrics: tuple[GatewayMetrics, int],  # noqa: F811 - the fixture imported above
) -> None:
    metrics, metrics_port = gateway_metrics
    queue = metrics.engine_queue_depth.labels(pool=POOL, sla_tier="premium")
    queue.set(0)
    group_nodes = [n.name for n in full_cluster.layout.dedicated_groups[GROUP]]
    # Each kwok node offers 8 GPUs and 512Gi: one qwen72b replica (8 GPUs, 288Gi) per node.
    holds = len(group_nodes)
    assert 1 < holds < MAX_REPLICAS, group_nodes
    apply_crds(full_cluster)
    with scratch_namespace(full_cluster, "keda-dedicated") as ns:
        prom = prometheus(scrape_config(ns, metrics_port))
        md_path = f"{API}/namespaces/{ns}/modeldeployments/{MD}"
        tn_path = f"{API}/namespaces/{ns}/tenants/{TENANT}"
        sts_path = f"/apis/apps/v1/namespaces/{ns}/statefulsets/{MD}-{POOL}-engine"
        create(
            full_cluster,
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": "bank-api-key",
                    "namespace": ns,
                    "labels": {"kvfleet.io/tenant": TENANT},
                },
                "data": {"api-key": base64.b64encode(BANK_KEY.encode()).decode()},
            },
        )
        doc = load_example("modeldeployment-qwen72b.yaml", ns)
        doc["spec"]["pool"]["replicas"] = 1
        # The platform's Prometheus and signals; the shared pool itself does not autoscale.
        doc["spec"]["pool"]["autoscaling"] = {
            "prometheusAddress": prom.url,
            "pollingIntervalSeconds": 2,
            "signals": {"queuePerReplica": {"premium": PREMIUM_PER_REPLICA}},
        }
        create(full_cluster, doc)
        tenant = load_example("tenant-bank.yaml", ns)
        tenant["spec"]["dedicated"]["autoscaling"] = {
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": MAX_REPLICAS,
        }
        create(full_cluster, tenant)  # the real API server's schema and CEL rules accept the field

        # Without rights on scaledobjects: the tenant says why nothing scales it; the ModelDeployment, whose
        # own pool does not autoscale, says nothing of it.
        result, _ = reconcile(full_cluster, ns, MD)
        assert not result.problem, result.problem
        degraded = _condition(get(full_cluster, tn_path), "Degraded")
        assert degraded.get("reason") == "AutoscalingUnavailable", degraded
        assert "rbac.keda=true" in degraded["message"], degraded
        assert _condition(get(full_cluster, md_path), "Degraded").get("reason") != "AutoscalingUnavailable"
        # The Tenant's scale subresource, as the HPA (or kubectl scale) uses it: a write past what the group
        # holds is taken, and the StatefulSet still runs no more than the group holds.
        scale_path = f"{tn_path}/scale"
        scale = get(full_cluster, scale_path)
        assert scale["spec"]["replicas"] == 1 and scale["status"]["replicas"] == 1, scale
        assert f"kvfleet.io/pool={POOL}" in scale["status"]["selector"], scale
        scale["spec"]["replicas"] = MAX_REPLICAS
        status, body = full_cluster.request("PUT", scale_path, scale)
        assert status == 200, body
        assert get(full_cluster, tn_path)["spec"]["dedicated"]["replicas"] == MAX_REPLICAS
        reconcile(full_cluster, ns, MD)
        assert get(full_cluster, sts_path)["spec"]["replicas"] == holds
        assert get(full_cluster, scale_path)["status"]["replicas"] == holds
        scale = get(full_cluster, scale_path)
        scale["spec"]["replicas"] = 1
        status, body = full_cluster.request("PUT", scale_path, scale)
        assert status == 200, body
        reconcile(full_cluster, ns, MD)
        assert get(full_cluster, sts_path)["spec"]["replicas"] == 1

        # With the rights (and KEDA serving keda.sh/v1alpha1): the Tenant's ScaledObject, its maximum
        # clamped to the group, and the tenant says so with the group's figures.
        result, _ = reconcile(full_cluster, ns, MD, KEDA_RIGHTS)
        assert not result.problem, result.problem
        bank = get(full_cluster, tn_path)
        degraded = _condition(bank, "Degraded")
        assert degraded.get("reason") == "MaxReplicasClamped", bank["status"]
        assert (
            f"GPU group {GROUP} holds {holds} replica(s) ({holds} schedulable node(s)" in degraded["message"]
        )
        assert bank["status"]["replicas"] == 1, bank["status"]
        so_path = f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects/{MD}-{POOL}-engine"
        so = get(full_cluster, so_path)
        assert so["metadata"]["ownerReferences"][0]["uid"] == bank["metadata"]["uid"]
        assert so["spec"]["scaleTargetRef"] == {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "Tenant",
            "name": TENANT,
        }
        assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, holds)
        triggers = {t["name"]: t["metadata"]["query"] for t in so["spec"]["triggers"]}
        assert list(triggers) == ["queue-premium", "kv-usage"]
        assert f'pool="{POOL}"' in triggers["queue-premium"]
        # Prometheus has this pool's queue under the rendered selector (not only `or vector(0)`).
        wait_for(
            lambda: prom.query(triggers["queue-premium"].removesuffix(" or vector(0)")),
            timeout=STEP_S,
            what="the dedicated pool's queue in Prometheus under the rendered selector",
        )
        hpa_path = (
            f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/keda-hpa-{MD}-{POOL}-engine"
        )

        def hpa() -> dict[str, Any] | None:
            status, body = full_cluster.request("GET", hpa_path)
            return body if status == 200 else None

        created = wait_for(hpa, timeout=STEP_S, what="the HPA KEDA creates for the Tenant's ScaledObject")
        assert created["spec"]["scaleTargetRef"] == {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "Tenant",
            "name": TENANT,
        }
        assert (created["spec"]["minReplicas"], created["spec"]["maxReplicas"]) == (1, holds)

        # The step: sixteen premium requests queued on the pool, four replicas' worth: the HPA asks for four
        # and is held at what the group holds.
        queue.set(MAX_REPLICAS * PREMIUM_PER_REPLICA)
        wait_for(
            lambda: get(full_cluster, tn_path)["spec"]["dedicated"]["replicas"] == holds,
            timeout=STEP_S,
            what=f"the HPA scaling the Tenant's dedicated pool to {holds} replicas",
        )

        def limited_by_max() -> dict[str, Any] | None:
            body = hpa()
            return body if body and _condition(body, "ScalingLimited").get("status") == "True" else None

        limited = wait_for(
            limited_by_max,
            timeout=STEP_S,
            what="the HPA saying it is limited by its maximum",
        )
        assert _condition(limited, "ScalingLimited")["reason"] == "TooManyReplicas", limited["status"]
        assert limited["status"]["desiredReplicas"] == holds
        # The operator turns the new spec into the dedicated StatefulSet's replicas, and no further.
        reconcile(full_cluster, ns, MD, KEDA_RIGHTS)
        assert get(full_cluster, sts_path)["spec"]["replicas"] == holds
        assert get(full_cluster, tn_path)["status"]["replicas"] == holds

        # A node of the group cordoned: the group holds one replica less; the ScaledObject's maximum, the
        # HPA's and the StatefulSet follow, and the tenant says what is left.
        try:
            _cordon(full_cluster, group_nodes[-1], True)
            reconcile(full_cluster, ns, MD, KEDA_RIGHTS)
            assert get(full_cluster, so_path)["spec"]["maxReplicaCount"] == holds - 1
            assert get(full_cluster, sts_path)["spec"]["replicas"] == holds - 1  # no drain grace here
            message = _condition(get(full_cluster, tn_path), "Degraded")["message"]
            assert f"holds {holds - 1} replica(s) ({holds - 1} schedulable node(s)" in message, message
            wait_for(
                lambda: (hpa() or {}).get("spec", {}).get("maxReplicas") == holds - 1,
                timeout=STEP_S,
                what="KEDA carrying the group's new capacity to the HPA's maximum",
            )
            wait_for(
                lambda: get(full_cluster, tn_path)["spec"]["dedicated"]["replicas"] == holds - 1,
                timeout=STEP_S,
                what="the HPA lowering spec.dedicated.replicas to what the group holds",
            )
        finally:
            _cordon(full_cluster, group_nodes[-1], False)
        reconcile(full_cluster, ns, MD, KEDA_RIGHTS)
        assert get(full_cluster, so_path)["spec"]["maxReplicaCount"] == holds
