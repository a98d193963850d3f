"""KEDA scales a kvfleet ModelDeployment on a metric kvfleet exports, through the real chain.

The gateway's ``kvfleet_gateway_engine_queue_depth`` (its own metrics registry, served over HTTP) →
Prometheus (scraping every second) → KEDA's operator (a ``prometheus`` trigger) → KEDA's metrics API
server, registered with the API server's aggregator for ``external.metrics.k8s.io`` → the HPA KEDA
created, evaluated by kube-controller-manager's HPA controller → the ModelDeployment's scale subresource
(``spec.pool.replicas``) → the operator's reconcile → the engine StatefulSet. Nothing in it is mocked:
KEDA v2.21.0 built from its Go module (``hack/build-cluster.sh``, step ``keda``), started by the ``keda``
fixture (:mod:`devcluster.keda`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cluster_helpers import apply_crds, scratch_namespace, wait_for
from devcluster import ControlPlane, PrometheusServer, build_scrape_config
from devcluster.keda import Keda
from prometheus_client import start_http_server
from test_operator_reconcile import create, get, load_example, reconcile

from factories import free_port
from kvfleet_runtime.gateway.metrics import ENGINE_QUEUE_DEPTH, GatewayMetrics

pytestmark = pytest.mark.cluster

MD = "qwen72b"
#: Queued premium requests per engine replica the pool is sized for (the trigger's threshold).
TARGET_PER_REPLICA = 4
QUERY = f'sum({ENGINE_QUEUE_DEPTH}{{pool="shared",sla_tier="premium"}})'
#: How long a step of the chain may take on a loaded 2-core machine: Prometheus scrapes every second, the
#: HPA controller evaluates every 3 s (devcluster.cluster.HPA_SYNC_PERIOD_S).
STEP_S = 90


@pytest.fixture
def gateway_metrics() -> Iterator[tuple[GatewayMetrics, int]]:
    """The gateway's metrics registry served on a free loopback port (what Prometheus scrapes)."""
    metrics = GatewayMetrics()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    try:
        yield metrics, port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def scaled_object(namespace: str, prometheus_url: str) -> dict[str, Any]:
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": f"{MD}-engine", "namespace": namespace},
        "spec": {
            "scaleTargetRef": {"apiVersion": "kvfleet.io/v1alpha1", "kind": "ModelDeployment", "name": MD},
            "pollingInterval": 2,
            "minReplicaCount": 1,
            "maxReplicaCount": 3,
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {
                        "serverAddress": prometheus_url,
                        "query": QUERY,
                        "threshold": str(TARGET_PER_REPLICA),
                    },
                }
            ],
        },
    }


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), {})


def test_a_premium_queue_step_scales_a_model_deployment_from_one_to_two_replicas_through_keda(
    full_cluster: ControlPlane,
    keda: Keda,
    prometheus: Callable[..., PrometheusServer],
    gateway_metrics: tuple[GatewayMetrics, int],
) -> None:
    metrics, metrics_port = gateway_metrics
    queue = metrics.engine_queue_depth.labels(pool="shared", sla_tier="premium")
    queue.set(0)
    prom = prometheus(build_scrape_config({"gateway": [f"127.0.0.1:{metrics_port}"]}, interval="1s"))
    wait_for(lambda: prom.query(QUERY), timeout=STEP_S, what="the queue depth in Prometheus")

    apply_crds(full_cluster)
    with scratch_namespace(full_cluster, "keda") as ns:
        # A CRD just (re)applied answers 429 "storage is (re)initializing" for a moment after Established.
        for plural in ("tenants", "modeldeployments"):
            wait_for(
                lambda plural=plural: (
                    full_cluster.request("GET", f"/apis/kvfleet.io/v1alpha1/namespaces/{ns}/{plural}")[0]
                    == 200
                ),
                what=f"{plural} served",
            )
        md_path = f"/apis/kvfleet.io/v1alpha1/namespaces/{ns}/modeldeployments/{MD}"
        doc = load_example("modeldeployment-qwen72b.yaml", ns)
        doc["spec"]["pool"]["replicas"] = 1
        create(full_cluster, doc)
        result, _ = reconcile(full_cluster, ns, MD)
        assert not result.problem, result.problem
        md = get(full_cluster, md_path)
        # The scale subresource the HPA reads: replicas and the engine pods' selector, from the status.
        assert md["status"]["replicas"] == 1 and md["status"]["selector"], md["status"]

        so = scaled_object(ns, prom.url)
        status, body = full_cluster.request(
            "POST", f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects", so
        )
        assert status == 201, body

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
        [metric] = created["spec"]["metrics"]
        assert metric["type"] == "External", metric
        assert metric["external"]["target"] == {
            "type": "AverageValue",
            "averageValue": str(TARGET_PER_REPLICA),
        }

        # Before the step: the HPA controller reads the metric through the aggregator (ScalingActive) and
        # sees the empty queue; the ModelDeployment stays at one replica.
        def reading(value: str) -> dict[str, Any] | None:
            body = hpa()
            if body is None or _condition(body, "ScalingActive").get("status") != "True":
                return None
            current = (body.get("status") or {}).get("currentMetrics") or []
            values = [m["external"]["current"].get("averageValue") for m in current if m.get("external")]
            return body if values == [value] else None

        quiet = wait_for(lambda: reading("0"), timeout=STEP_S, what="the HPA reading an empty queue")
        assert quiet["status"]["desiredReplicas"] == 1
        assert get(full_cluster, md_path)["spec"]["pool"]["replicas"] == 1
        ready = wait_for(
            lambda: _condition(get(full_cluster, so_path(ns)), "Ready").get("status") == "True",
            timeout=STEP_S,
            what="the ScaledObject Ready",
        )
        assert ready

        # The step: eight premium requests queued for one replica sized for four.
        queue.set(2 * TARGET_PER_REPLICA)
        wait_for(
            lambda: get(full_cluster, md_path)["spec"]["pool"]["replicas"] == 2,
            timeout=STEP_S,
            what="the HPA scaling the ModelDeployment to 2 replicas",
        )
        scaled = hpa()
        assert scaled is not None and scaled["status"]["desiredReplicas"] == 2, scaled
        # KEDA's own polling (every pollingInterval) marks the ScaledObject Active on a non-zero value.
        wait_for(
            lambda: _condition(get(full_cluster, so_path(ns)), "Active").get("status") == "True",
            timeout=STEP_S,
            what="the ScaledObject Active",
        )

        # The operator turns the new spec into a second engine replica.
        result, _ = reconcile(full_cluster, ns, MD)
        assert not result.problem, result.problem
        sts = get(full_cluster, f"/apis/apps/v1/namespaces/{ns}/statefulsets/{MD}-engine")
        assert sts["spec"]["replicas"] == 2
        assert get(full_cluster, md_path)["status"]["replicas"] == 2
        # With two replicas the queue is at target: the HPA holds at two (within its tolerance).
        held = wait_for(lambda: reading(str(TARGET_PER_REPLICA)), timeout=STEP_S, what="the HPA at target")
        assert held["status"]["desiredReplicas"] == 2
        assert get(full_cluster, md_path)["spec"]["pool"]["replicas"] == 2


def so_path(namespace: str) -> str:
    return f"/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects/{MD}-engine"
