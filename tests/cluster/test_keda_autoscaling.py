"""KEDA scales a kvfleet ModelDeployment on a metric kvfleet exports, through the real chain.

The gateway's ``kvfleet_gateway_engine_queue_depth`` (its own metrics registry, served over HTTP) →
Prometheus (scraping every second) → KEDA's operator, running the ScaledObject the operator renders from
``spec.pool.autoscaling`` (``build/autoscaling.py``: every trigger, each query evaluated by Prometheus) →
KEDA's metrics API server, registered with the API server's aggregator for ``external.metrics.k8s.io`` →
the HPA KEDA created, evaluated by kube-controller-manager's HPA controller → the ModelDeployment's scale
subresource (``spec.pool.replicas``) → the operator's reconcile → the engine StatefulSet. Nothing in it is
mocked: KEDA v2.21.0 built from its Go module (``hack/build-cluster.sh``, step ``keda``), started by the
``keda`` fixture (:mod:`devcluster.keda`). The operator's reconcile creates the ScaledObject once it may
manage scaledobjects (the chart's ``rbac.keda``); before, it says ``AutoscalingUnavailable``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cluster_helpers import apply_crds, scratch_namespace, wait_for
from devcluster import ControlPlane, PrometheusServer
from devcluster.keda import Keda
from devcluster.realpods import kubectl
from test_operator_reconcile import CONFIG, create, get, load_example, reconcile

from gateway_support import serving_gateway_metrics
from kvfleet_operator.api.modeldeployment import ModelDeployment
from kvfleet_operator.build.autoscaling import build_scaled_object
from kvfleet_operator.build.common import owner_of
from kvfleet_operator.k8s import kinds
from kvfleet_runtime.gateway.metrics import GatewayMetrics

pytestmark = pytest.mark.cluster

MD = "qwen72b"
API = "/apis/kvfleet.io/v1alpha1"
#: Queued premium requests per engine replica the pool is sized for (the trigger's threshold).
PREMIUM_PER_REPLICA = 4
#: How long a step of the chain may take on a loaded 2-core machine: Prometheus scrapes every second, KEDA
#: polls every 2 s, the HPA controller evaluates every 3 s (devcluster.cluster.HPA_SYNC_PERIOD_S).
STEP_S = 90
#: What each engine replica is given at once (spec.gateway.engineInFlightPerReplica): the seats the
#: guarantee floor counts per replica; tenant-saas.yaml's maxConcurrent 64 then needs FLOOR replicas, which
#: the fake GPU nodes (4 x 8 GPUs, 8 per replica) have room for.
SEATS_PER_REPLICA = 24
FLOOR = 3
#: The operator as the chart runs it with rbac.keda=true (KVFLEET_EXPOSURE_KINDS=ScaledObject).
KEDA_RIGHTS = dataclasses.replace(CONFIG, exposure=(kinds.SCALED_OBJECT,))


@pytest.fixture
def gateway_metrics() -> Iterator[tuple[GatewayMetrics, int]]:
    """The gateway's metrics registry served on a free loopback port (what Prometheus scrapes)."""
    with serving_gateway_metrics() as served:
        yield served


def scrape_config(namespace: str, port: int) -> dict[str, Any]:
    """The gateway's endpoint with the labels a Kubernetes scrape attaches (Prometheus Operator's
    ServiceMonitor: namespace, pod), which the rendered queries select this ModelDeployment's gateway by."""
    target = {"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": namespace, "pod": f"{MD}-gateway-0"}}
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "gateway", "static_configs": [target]}],
    }


def autoscaling(prometheus_url: str) -> dict[str, Any]:
    """Every signal on: the tier queues (basic capped at 2), KV use and premium TTFT."""
    return {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 3,
        "bestEffortMaxReplicas": 2,
        "prometheusAddress": prometheus_url,
        "pollingIntervalSeconds": 2,
        "signals": {
            "queuePerReplica": {"premium": PREMIUM_PER_REPLICA},
            "ttft": {"tier": "premium", "p99Seconds": 0.5},
        },
    }


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), {})


def _current(metric: dict[str, Any]) -> str | None:
    current = metric["external"]["current"]
    value = current.get("averageValue", current.get("value"))
    return None if value is None else str(value)


def test_a_premium_queue_step_scales_a_model_deployment_from_one_to_two_replicas_through_keda(
    full_cluster: ControlPlane,
    keda: Keda,
    prometheus: Callable[..., PrometheusServer],
    gateway_metrics: tuple[GatewayMetrics, int],
) -> None:
    metrics, metrics_port = gateway_metrics
    queue = metrics.engine_queue_depth.labels(pool="shared", sla_tier="premium")
    queue.set(0)
    apply_crds(full_cluster)
    with scratch_namespace(full_cluster, "keda") as ns:
        prom = prometheus(scrape_config(ns, metrics_port))
        md_path = f"{API}/namespaces/{ns}/modeldeployments/{MD}"
        doc = load_example("modeldeployment-qwen72b.yaml", ns)
        # No NVMe tier: its claims (StorageClass local-nvme) have no provisioner here, and kwok can only
        # run engine pods whose volumes bind (the floor's replicas below must turn ready).
        doc["spec"]["kvCache"].pop("nvme", None)
        doc["spec"]["pool"]["replicas"] = 1
        doc["spec"]["pool"]["autoscaling"] = autoscaling(prom.url)
        doc["spec"].setdefault("gateway", {})["engineInFlightPerReplica"] = SEATS_PER_REPLICA
        create(full_cluster, doc)  # the real API server's schema and CEL rules accept the field
        # Without rights on scaledobjects: served at spec.pool.replicas, and the status says why not scaled.
        result, _ = reconcile(full_cluster, ns, MD)
        assert not result.problem, result.problem
        degraded = _condition(get(full_cluster, md_path), "Degraded")
        assert degraded.get("reason") == "AutoscalingUnavailable", degraded
        assert "rbac.keda=true" in degraded["message"], degraded
        # With them (and KEDA serving keda.sh/v1alpha1): the reconcile creates the ScaledObject.
        result, _ = reconcile(full_cluster, ns, MD, KEDA_RIGHTS)
        assert not result.problem, result.problem
        md = get(full_cluster, md_path)
        assert _condition(md, "Degraded").get("reason") != "AutoscalingUnavailable", md["status"]
        # The scale subresource the HPA reads: replicas and the engine pods' selector, from the status.
        assert md["status"]["replicas"] == 1 and md["status"]["selector"], md["status"]

        parsed = ModelDeployment.model_validate(md)
        so = build_scaled_object(ns, MD, parsed.spec.pool.autoscaling, owner_of(parsed))
        assert so is not None
        names = [t["name"] for t in so["spec"]["triggers"]]
        assert names == ["queue-premium", "queue-standard", "queue-basic", "kv-usage", "ttft-premium"]
        premium_query = so["spec"]["triggers"][0]["metadata"]["query"]
        # Prometheus has the gateway's premium queue under the rendered selector (not only `or vector(0)`).
        wait_for(
            lambda: prom.query(premium_query.removesuffix(" or vector(0)")),
            timeout=STEP_S,
            what="the premium queue in Prometheus under the rendered selector",
        )
        so_path = f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects/{so['metadata']['name']}"
        live = get(full_cluster, so_path)  # created by the reconcile, as rendered
        assert live["spec"]["triggers"] == so["spec"]["triggers"], live["spec"]
        assert live["metadata"]["ownerReferences"][0]["uid"] == md["metadata"]["uid"]
        hpa_path = f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/keda-hpa-{MD}-engine"

        def hpa() -> dict[str, Any] | None:
            status, body = full_cluster.request("GET", hpa_path)
            return body if status == 200 else None

        created = wait_for(hpa, timeout=STEP_S, what="the HPA KEDA creates for the ScaledObject")
        assert created["spec"]["scaleTargetRef"] == {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "ModelDeployment",
            "name": MD,
        }
        assert (created["spec"]["minReplicas"], created["spec"]["maxReplicas"]) == (1, 3)
        specs = created["spec"]["metrics"]
        # One external metric per trigger, in the rendered order (KEDA names them s<index>-prometheus).
        assert [m["external"]["metric"]["name"] for m in specs] == [f"s{i}-prometheus" for i in range(5)]
        assert specs[0]["external"]["target"] == {
            "type": "AverageValue",
            "averageValue": str(PREMIUM_PER_REPLICA),
        }
        assert [m["external"]["target"]["type"] for m in specs[3:]] == ["Value", "Value"]

        # Every trigger's query is read through the aggregator (ScalingActive, one current value per
        # metric); premium's is the one under test.
        def reading(premium: str) -> dict[str, Any] | None:
            body = hpa()
            if body is None or _condition(body, "ScalingActive").get("status") != "True":
                return None
            current = [m for m in (body.get("status") or {}).get("currentMetrics") or [] if m.get("external")]
            values = {m["external"]["metric"]["name"]: _current(m) for m in current}
            if len(values) != len(names) or None in values.values():
                return None
            return body if values["s0-prometheus"] == premium else None

        # Before the step: an empty queue, and nothing else asks for more (the other signals read 0).
        quiet = wait_for(lambda: reading("0"), timeout=STEP_S, what="the HPA reading every signal at 0")
        assert {_current(m) for m in quiet["status"]["currentMetrics"]} == {"0"}
        assert quiet["status"]["desiredReplicas"] == 1
        assert get(full_cluster, md_path)["spec"]["pool"]["replicas"] == 1
        wait_for(
            lambda: _condition(get(full_cluster, so_path), "Ready").get("status") == "True",
            timeout=STEP_S,
            what="the ScaledObject Ready",
        )

        # The step: eight premium requests queued for one replica sized for four.
        queue.set(2 * PREMIUM_PER_REPLICA)
        wait_for(
            lambda: get(full_cluster, md_path)["spec"]["pool"]["replicas"] == 2,
            timeout=STEP_S,
            what="the HPA scaling the ModelDeployment to 2 replicas",
        )
        scaled = hpa()
        assert scaled is not None and scaled["status"]["desiredReplicas"] == 2, scaled
        # KEDA's own polling (every pollingInterval) marks the ScaledObject Active on a non-zero value.
        wait_for(
            lambda: _condition(get(full_cluster, so_path), "Active").get("status") == "True",
            timeout=STEP_S,
            what="the ScaledObject Active",
        )

        # The operator turns the new spec into a second engine replica (and keeps its ScaledObject as is).
        result, _ = reconcile(full_cluster, ns, MD, KEDA_RIGHTS)
        assert not result.problem, result.problem
        sts = get(full_cluster, f"/apis/apps/v1/namespaces/{ns}/statefulsets/{MD}-engine")
        assert sts["spec"]["replicas"] == 2
        assert get(full_cluster, md_path)["status"]["replicas"] == 2
        # With two replicas the queue is at target: the HPA holds at two (within its tolerance).
        held = wait_for(lambda: reading(str(PREMIUM_PER_REPLICA)), timeout=STEP_S, what="the HPA at target")
        assert held["status"]["desiredReplicas"] == 2
        assert get(full_cluster, md_path)["spec"]["pool"]["replicas"] == 2

        # The guarantee floor (build/autoscaling.py): a standard-tier tenant promised 64 requests at once,
        # at SEATS_PER_REPLICA per replica, needs 3 replicas; two cannot seat it, so it waits
        # (WaitingForCapacity) and its seats raise the floor. The reconcile runs 3 at once and makes 3 the
        # ScaledObject's minimum; KEDA carries it to the HPA, which writes it to spec.pool.replicas.
        saas = load_example("tenant-saas.yaml", ns)
        saas["spec"]["kvQuota"]["nvme"] = "0"  # the pool has no NVMe tier here (above)
        create(full_cluster, saas)
        result, _ = reconcile(full_cluster, ns, MD, KEDA_RIGHTS)
        assert not result.problem, result.problem
        sts_path = f"/apis/apps/v1/namespaces/{ns}/statefulsets/{MD}-engine"
        assert get(full_cluster, sts_path)["spec"]["replicas"] == FLOOR
        md = get(full_cluster, md_path)
        assert md["status"]["guaranteed"]["waitingSeats"] == 64, md["status"]["guaranteed"]
        assert md["status"]["guaranteed"]["seats"] == 0 and md["status"]["guaranteed"]["replicas"] == FLOOR
        assert md["status"]["replicas"] == FLOOR  # what the scale subresource tells the HPA runs
        tenant_path = f"{API}/namespaces/{ns}/tenants/saas"
        waiting = _condition(get(full_cluster, tenant_path), "Ready")
        assert waiting.get("reason") == "WaitingForCapacity", waiting
        assert "need 3 ready replicas at 24 per replica" in waiting["message"], waiting
        assert "admittedQuota" not in get(full_cluster, tenant_path)["status"]
        # `kubectl get md` shows it (the CRD's printer column, as the API server serves the table).
        table = kubectl(full_cluster, "get", "md", MD, "-n", ns)
        header, row = table.splitlines()[:2]
        assert header.split()[2:5] == ["REPLICAS", "FLOOR", "READY"] and row.split()[3] == str(FLOOR), table
        assert get(full_cluster, so_path)["spec"]["minReplicaCount"] == FLOOR
        wait_for(
            lambda: (hpa() or {}).get("spec", {}).get("minReplicas") == FLOOR,
            timeout=STEP_S,
            what="KEDA carrying the floor to the HPA's minimum",
        )
        wait_for(
            lambda: get(full_cluster, md_path)["spec"]["pool"]["replicas"] == FLOOR,
            timeout=STEP_S,
            what="the HPA raising spec.pool.replicas to the floor",
        )
        # Capacity arrives: kwok runs the third engine pod (the fake GPU nodes have room for it) and the
        # StatefulSet counts it ready; the next reconcile (a pod turning ready wakes the operator's) admits
        # the waiting tenant, and its seats are promised from then on.
        wait_for(
            lambda: ((get(full_cluster, sts_path).get("status") or {}).get("readyReplicas") or 0) >= FLOOR,
            timeout=STEP_S,
            what=f"{FLOOR} engine replicas ready on the fake GPU nodes",
        )
        result, _ = reconcile(full_cluster, ns, MD, KEDA_RIGHTS)
        assert not result.problem, result.problem
        guaranteed = get(full_cluster, md_path)["status"]["guaranteed"]
        assert (guaranteed["seats"], guaranteed["waitingSeats"], guaranteed["replicas"]) == (64, 0, FLOOR)
        admitted = get(full_cluster, tenant_path)
        assert admitted["status"].get("admittedQuota"), admitted["status"]
        assert _condition(admitted, "Ready").get("reason") != "WaitingForCapacity", admitted["status"]
        # The queue empties: every signal reads 0, and the HPA still does not go below the floor.
        queue.set(0)
        quiet = wait_for(lambda: reading("0"), timeout=STEP_S, what="the HPA reading every signal at 0 again")
        assert quiet["status"]["desiredReplicas"] == FLOOR
        assert get(full_cluster, md_path)["spec"]["pool"]["replicas"] == FLOOR
