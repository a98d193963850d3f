"""Tier-aware autoscaling on kwok GPU nodes, through real KEDA, Prometheus and the HPA: one command.

    PYTHONPATH=hack:tests:tests/cluster .venv/bin/python benchmarks/autoscaling_kwok.py [--rounds 3]

A full local control plane (kube-apiserver, etcd, kube-controller-manager with its HPA controller,
kube-scheduler, kwok) with four kwok GPU nodes of 8 H200 each, KEDA (``devcluster.keda``), a real
Prometheus scraping the gateway's metrics registry (``GatewayMetrics``, served on loopback with the labels
a Kubernetes scrape attaches: the load signal, ``kvfleet_gateway_engine_queue_depth{pool,sla_tier}``, is
set there; kwok engines run no code, so no traffic is driven) and ``kvfleet operator`` as a process
(reconciles follow events on their own). One ModelDeployment autoscales its shared pool between 1 and 4
replicas of 8 GPUs (one replica per node), 4 queued requests per replica for every tier, best-effort
(basic) load capped at 2 replicas, 24 seats per replica (``spec.gateway.engineInFlightPerReplica``); a
premium tenant promised 24 requests at once (one replica: the floor is 1) is admitted throughout.

Each round runs four phases, each from a pool settled at one replica:

1. **Premium burst**: the premium queue steps to 4 replicas' worth (16); the time until the HPA wants 4,
   ``spec.pool.replicas`` is 4 (the HPA's write), the engine StatefulSet asks for 4, and 4 engine pods are
   Ready (kwok marks them Ready once scheduled); then the queue empties and the time back to 1.
2. **Best-effort burst of the same size**: the basic queue steps to 16 for ``--best-effort-window``
   seconds; the most replicas seen (HPA desired, ``spec.pool.replicas``, StatefulSet, Ready pods), sampled
   throughout; the cap is 2.
3. **The floor holds**: a standard tenant promised 24 more seats makes the floor 2 replicas; a premium
   burst takes the pool to 4, then every signal reads 0; the fewest replicas seen over the HPA's scale-down
   stabilization window plus ``--floor-hold`` seconds (target: never below 2).
4. **Pending tenants admitted when capacity arrives**: the GPUs of every node are filled (a pod bound to
   each node takes its free GPUs: other work), so a second engine replica cannot schedule; three tenants
   that do not fit the ready replicas' seats are created a second apart (standard, premium, standard, 24
   seats each): they wait (``WaitingForCapacity``), their seats raise the floor to 4 and the StatefulSet
   with it, and 3 engine pods stay Pending. Then a kwok GPU node is added, one at a time, three times; for
   each: the time from the node's creation to its engine pod Ready, to the next waiting tenant admitted
   (listed in the gateways' tenant table, the ``<name>-tenants`` ConfigMap) and to every tenant Ready;
   the admission order (expected: premium first, then the standard tenants oldest first).

The HPA's scale-down stabilization is Kubernetes' 300 s by default, and the ScaledObject the operator
renders sets none (nor does ``spec.pool.autoscaling`` have a field for it). So that a round takes minutes,
the benchmark sets ``spec.advanced.horizontalPodAutoscalerConfig.behavior.scaleDown
.stabilizationWindowSeconds`` on the live ScaledObject under a field manager of its own
(``--scale-down-stabilization``, 15 s; ``0`` leaves the default, and every scale-in then takes 5 minutes),
which the operator's server-side apply leaves alone; it only shortens how long the HPA waits before a
scale-in, so a floor that holds over it holds a fortiori over 300 s. The operator's scale-in drain
(``KVFLEET_DRAIN_SECONDS``; 120 s by default) is ``--drain-seconds`` (10 s): kwok engines serve nothing to
drain.

Writes ``benchmarks/results/autoscaling_kwok.json`` (``--results``) and prints one JSON line per phase.
``--keep-logs DIR`` copies the operator's, KEDA's and the control plane's logs there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cluster_helpers import apply_crds, create_namespace
from devcluster import (
    GPU_POOL_LABEL,
    GPU_RESOURCE,
    ControlPlane,
    FakeNode,
    PrometheusServer,
    build_layout,
    build_node_manifest,
    start_control_plane,
    start_prometheus,
)
from devcluster.keda import Keda, start_keda
from operators import OperatorReplica
from results_format import (
    Figure,
    Machine,
    add_results_argument,
    command_line,
    measured,
    write_results,
)

from gateway_support import serving_gateway_metrics
from kvfleet_operator.api.modeldeployment import PoolAutoscaling
from kvfleet_operator.build.autoscaling import build_triggers, scaled_object_name
from kvfleet_runtime.config import TenantTable
from kvfleet_runtime.gateway.metrics import GatewayMetrics

REPO = Path(__file__).resolve().parents[1]
NAME = "autoscaling_kwok"
API = "/apis/kvfleet.io/v1alpha1"
MD = "burst"
#: The autoscaling the ModelDeployment asks for: 1..4 replicas, best-effort load alone up to 2.
MIN_REPLICAS, MAX_REPLICAS, BEST_EFFORT_CAP = 1, 4, 2
#: Queued requests per replica, every tier alike, so a burst of one size asks for as many replicas in each.
QUEUE_PER_REPLICA = 4
#: The burst: MAX_REPLICAS replicas' worth of queue.
BURST = MAX_REPLICAS * QUEUE_PER_REPLICA
#: Seats per replica (spec.gateway.engineInFlightPerReplica) and what each guaranteed tenant is promised:
#: one replica's worth, so the floor is the number of such tenants.
SEATS_PER_REPLICA = 24
GPUS_PER_NODE = 8
#: The premium tenant admitted throughout (floor 1); phase 3's standard tenant (floor 2); phase 4's
#: waiting tenants, in creation order.
BASE_TENANT = "base-premium"
FLOOR_TENANT = "floor-standard"
WAITING = (("wait-standard-a", "standard"), ("wait-premium", "premium"), ("wait-standard-b", "standard"))
#: Phase 4 admits premium first, then standard by creation time.
EXPECTED_ORDER = ["wait-premium", "wait-standard-a", "wait-standard-b"]
FIELD_MANAGER = "kvfleet-benchmark"
#: Kubernetes' scale-down stabilization when an HPA's behavior sets none.
DEFAULT_STABILIZATION_S = 300
#: How often the sampler reads the pool (seconds).
SAMPLE_S = 0.25
#: How long one step of the chain may take before the round is called failed.
STEP_TIMEOUT_S = 180.0
Obj = dict[str, Any]


# --- what is created (pure) ------------------------------------------------------------------------------


def autoscaling_spec(prometheus_url: str) -> Obj:
    """``spec.pool.autoscaling``: every tier's queue at the same target, best-effort capped; KV use on
    (its series are absent for kwok engines, so it reads 0)."""
    return {
        "enabled": True,
        "minReplicas": MIN_REPLICAS,
        "maxReplicas": MAX_REPLICAS,
        "bestEffortMaxReplicas": BEST_EFFORT_CAP,
        "prometheusAddress": prometheus_url,
        "pollingIntervalSeconds": 2,
        "signals": {
            "queuePerReplica": {
                "premium": QUEUE_PER_REPLICA,
                "standard": QUEUE_PER_REPLICA,
                "basic": QUEUE_PER_REPLICA,
            }
        },
    }


def model_deployment(namespace: str, prometheus_url: str) -> Obj:
    """The example's Qwen2.5-72B on 8 H200 per replica (examples/modeldeployment-qwen72b.yaml) without its
    NVMe tier (kwok nodes have no local volumes), one gateway, autoscaled."""
    doc: Obj = yaml.safe_load((REPO / "examples" / "modeldeployment-qwen72b.yaml").read_text())
    doc["metadata"] = {"name": MD, "namespace": namespace}
    spec = doc["spec"]
    spec["kvCache"].pop("nvme", None)
    spec["kvCache"]["cpuSize"] = "64Gi"
    spec["pool"]["replicas"] = MIN_REPLICAS
    spec["pool"]["autoscaling"] = autoscaling_spec(prometheus_url)
    spec["gateway"]["replicas"] = 1
    spec["gateway"]["engineInFlightPerReplica"] = SEATS_PER_REPLICA
    return doc


def tenant(namespace: str, name: str, tier: str, max_concurrent: int = SEATS_PER_REPLICA) -> Obj:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "modelDeploymentRef": {"name": MD},
            "tier": tier,
            "isolation": "salted",
            "kvQuota": {"hbm": "5%", "cpu": "2Gi"},
            "burstLimit": "20%",
            "rateLimits": {"requestsPerMinute": 600, "maxConcurrent": max_concurrent},
        },
    }


def scrape_config(namespace: str, port: int) -> Obj:
    """The gateway's endpoint with the labels a Kubernetes scrape attaches (namespace, pod), which the
    rendered queries select this ModelDeployment's gateway by."""
    target = {"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": namespace, "pod": f"{MD}-gateway-0"}}
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "gateway", "static_configs": [target]}],
    }


def scale_down_behavior(seconds: int) -> Obj:
    """The merge patch that sets the HPA's scale-down stabilization through the ScaledObject."""
    behavior = {"scaleDown": {"stabilizationWindowSeconds": seconds}}
    return {"spec": {"advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior}}}}


def filler_pod(namespace: str, node: str, gpus: int) -> Obj:
    """Other work holding ``gpus`` GPUs of ``node`` (bound to it: kwok runs it, the scheduler counts it)."""
    resources = {GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"gpu-filler-{node}", "namespace": namespace, "labels": {"app": "gpu-filler"}},
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "work",
                    "image": "busybox",
                    "resources": {"requests": resources, "limits": resources},
                }
            ],
            "tolerations": [{"operator": "Exists"}],
        },
    }


def arriving_node(name: str) -> FakeNode:
    """A shared-pool GPU node like the layout's (same labels, 8 GPUs)."""
    template = build_layout(shared_nodes=1, gpus_per_node=GPUS_PER_NODE, dedicated={}).shared_pool[0]
    labels = {**template.labels, "kubernetes.io/hostname": name}
    return FakeNode(name=name, labels=labels, gpus=GPUS_PER_NODE)


# --- reading the cluster (pure helpers) ------------------------------------------------------------------


def free_gpus(nodes: Sequence[Obj], pods: Sequence[Obj]) -> dict[str, int]:
    """Unrequested GPUs per node: allocatable less what the node's running or pending pods request."""
    used: dict[str, int] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if not node or phase in ("Succeeded", "Failed"):
            continue
        for c in pod["spec"].get("containers") or []:
            requests = (c.get("resources") or {}).get("requests") or {}
            used[node] = used.get(node, 0) + int(requests.get(GPU_RESOURCE, 0))
    free = {}
    for node in nodes:
        name = node["metadata"]["name"]
        allocatable = int(((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0))
        free[name] = allocatable - used.get(name, 0)
    return free


def condition(obj: Obj, kind: str = "Ready") -> Obj:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def pod_ready(pod: Obj) -> bool:
    return condition(pod).get("status") == "True"


@dataclass(frozen=True)
class Sample:
    """One reading of the pool, ``t`` seconds on the monotonic clock."""

    t: float
    hpa_desired: int | None
    hpa_min: int | None
    spec_replicas: int | None  # spec.pool.replicas: what the HPA wrote
    floor: int | None  # status.guaranteed.replicas
    sts_replicas: int | None  # the engine StatefulSet's spec.replicas
    pods: int  # engine pods not being deleted
    pods_ready: int
    pods_pending: int
    tenants_ready: Mapping[str, bool] = field(default_factory=dict)
    tenants_reason: Mapping[str, str] = field(default_factory=dict)
    tenants_admitted: frozenset[str] = frozenset()  # those with status.admittedQuota


def ready_at_least(pods: int) -> Callable[[Sample], bool]:
    return lambda s: s.pods_ready >= pods


def tenant_ready(name: str) -> Callable[[Sample], bool]:
    return lambda s: s.tenants_ready.get(name, False)


def tenant_admitted(name: str) -> Callable[[Sample], bool]:
    return lambda s: name in s.tenants_admitted


def first_at(samples: Sequence[Sample], since: float, check: Callable[[Sample], bool]) -> float | None:
    """Seconds from ``since`` to the first sample at or after it for which ``check`` holds."""
    return next((round(s.t - since, 2) for s in samples if s.t >= since and check(s)), None)


def extreme(
    samples: Sequence[Sample],
    since: float,
    until: float,
    read: Callable[[Sample], int | None],
    pick: Callable[[Sequence[int]], int] = max,
) -> int | None:
    """The largest (``pick=max``) or smallest value ``read`` gives over the samples in [since, until]."""
    values = [v for s in samples if since <= s.t <= until and (v := read(s)) is not None]
    return pick(values) if values else None


def not_ready_seconds(samples: Sequence[Sample], since: float, until: float, name: str) -> float:
    """How long tenant ``name`` read not Ready in [since, until] (sum of the sample intervals)."""
    window = [s for s in samples if since <= s.t <= until]
    total = 0.0
    for a, b in itertools.pairwise(window):
        if not a.tenants_ready.get(name, False):
            total += b.t - a.t
    return round(total, 2)


def reasons_seen(samples: Sequence[Sample], since: float, until: float, name: str) -> list[str]:
    """The reasons of tenant ``name``'s ``Ready`` condition over [since, until], in the order first seen."""
    seen = [s.tenants_reason.get(name, "") for s in samples if since <= s.t <= until]
    return list(dict.fromkeys(seen))


def admission_order(admitted_at: Mapping[str, float | None]) -> list[str]:
    """The tenants in the order they were admitted (never-admitted ones left out)."""
    return [
        n
        for n, t in sorted(admitted_at.items(), key=lambda kv: (kv[1] is None, kv[1] or 0.0))
        if t is not None
    ]


def spread_of(values: Sequence[float | None], unit: str, note: str = "") -> Figure | None:
    """A figure over the rounds that measured it (``None`` values: rounds where it never happened)."""
    known = [v for v in values if v is not None]
    return Figure.of(known, unit, note=note) if known else None


# --- the running scene -----------------------------------------------------------------------------------


class Scene:
    """The cluster, KEDA, Prometheus, the gateway's metrics and the operator, and one ModelDeployment."""

    def __init__(self, plane: ControlPlane, namespace: str, metrics: GatewayMetrics) -> None:
        self.plane, self.namespace, self.metrics = plane, namespace, metrics
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        self.engine_selector = ""

    # paths
    @property
    def md_path(self) -> str:
        return f"{API}/namespaces/{self.namespace}/modeldeployments/{MD}"

    @property
    def sts_path(self) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{MD}-engine"

    @property
    def so_path(self) -> str:
        return f"/apis/keda.sh/v1alpha1/namespaces/{self.namespace}/scaledobjects/{scaled_object_name(MD)}"

    @property
    def hpa_path(self) -> str:
        name = f"keda-hpa-{scaled_object_name(MD)}"
        return f"/apis/autoscaling/v2/namespaces/{self.namespace}/horizontalpodautoscalers/{name}"

    def get(self, path: str) -> Obj | None:
        status, body = self.plane.request("GET", path, timeout=10)
        return body if status == 200 else None

    def queue(self, tier: str, value: float) -> None:
        self.metrics.engine_queue_depth.labels(pool="shared", sla_tier=tier).set(value)

    def quiet(self) -> None:
        for tier in ("premium", "standard", "basic"):
            self.queue(tier, 0)

    # sampling
    def read(self) -> Sample:
        md = self.get(self.md_path) or {}
        sts = self.get(self.sts_path) or {}
        hpa = self.get(self.hpa_path) or {}
        if not self.engine_selector and sts:
            labels = sts["spec"]["selector"]["matchLabels"]
            self.engine_selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        pods: list[Obj] = []
        if self.engine_selector:
            body = self.get(f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={self.engine_selector}")
            pods = [p for p in (body or {}).get("items") or [] if not p["metadata"].get("deletionTimestamp")]
        tenants = (self.get(f"{API}/namespaces/{self.namespace}/tenants") or {}).get("items") or []
        return Sample(
            t=time.monotonic(),
            hpa_desired=(hpa.get("status") or {}).get("desiredReplicas"),
            hpa_min=(hpa.get("spec") or {}).get("minReplicas"),
            spec_replicas=((md.get("spec") or {}).get("pool") or {}).get("replicas"),
            floor=((md.get("status") or {}).get("guaranteed") or {}).get("replicas"),
            sts_replicas=(sts.get("spec") or {}).get("replicas"),
            pods=len(pods),
            pods_ready=sum(pod_ready(p) for p in pods),
            pods_pending=sum((p.get("status") or {}).get("phase") == "Pending" for p in pods),
            tenants_ready={t["metadata"]["name"]: condition(t).get("status") == "True" for t in tenants},
            tenants_reason={t["metadata"]["name"]: str(condition(t).get("reason", "")) for t in tenants},
            tenants_admitted=frozenset(
                t["metadata"]["name"] for t in tenants if (t.get("status") or {}).get("admittedQuota")
            ),
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.samples.append(self.read())
            except (OSError, KeyError, TypeError, ValueError) as exc:  # a slow API server: keep sampling
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(max(0.0, SAMPLE_S - (time.monotonic() - started)))

    def start_sampling(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def stop_sampling(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def latest(self) -> Sample:
        return self.samples[-1]

    def wait(self, check: Callable[[Sample], bool], what: str, timeout: float = STEP_TIMEOUT_S) -> float:
        """Wait until a sample taken from now on satisfies ``check``; the monotonic time it was taken."""
        since = time.monotonic()
        deadline = since + timeout
        while time.monotonic() < deadline:
            found = next((s for s in reversed(self.samples) if s.t >= since and check(s)), None)
            if found is not None:
                return found.t
            time.sleep(SAMPLE_S / 2)
        last = self.samples[-1] if self.samples else None
        raise TimeoutError(f"{what}: not within {timeout:.0f} s (last sample: {last})")

    def settle(self, replicas: int = MIN_REPLICAS) -> float:
        """Every signal 0, and the pool back at ``replicas``: HPA, spec, StatefulSet and pods."""
        self.quiet()
        return self.wait(
            lambda s: (
                s.hpa_desired == replicas
                and s.spec_replicas == replicas
                and s.sts_replicas == replicas
                and s.pods == replicas
                and s.pods_ready == replicas
            ),
            f"the pool settled at {replicas}",
            timeout=STEP_TIMEOUT_S + 300,
        )

    # objects
    def create(self, path: str, doc: Obj) -> Obj:
        status, body = self.plane.request("POST", path, doc, timeout=30)
        if status != 201:
            raise RuntimeError(f"creating {doc['kind']} {doc['metadata']['name']}: {status} {body}")
        created: Obj = body
        return created

    def create_tenant(self, name: str, tier: str) -> Obj:
        return self.create(f"{API}/namespaces/{self.namespace}/tenants", tenant(self.namespace, name, tier))

    def delete(self, path: str) -> None:
        status, body = self.plane.request("DELETE", path, timeout=30)
        if status not in (200, 202, 404):
            raise RuntimeError(f"deleting {path}: {status} {body}")

    def delete_tenant(self, name: str) -> None:
        self.delete(f"{API}/namespaces/{self.namespace}/tenants/{name}")

    def table_tenants(self) -> set[str]:
        """The tenants the gateways serve: the ModelDeployment's tenant table."""
        cm = self.get(f"/api/v1/namespaces/{self.namespace}/configmaps/{MD}-tenants")
        if cm is None:
            return set()
        return set(TenantTable.model_validate_json(cm["data"]["tenants.json"]).tenants)


# --- the phases ------------------------------------------------------------------------------------------


def phase_premium_burst(scene: Scene) -> dict[str, Any]:
    scene.settle()
    t0 = time.monotonic()
    scene.queue("premium", BURST)
    scene.wait(lambda s: s.pods_ready == MAX_REPLICAS and s.sts_replicas == MAX_REPLICAS, "4 engines Ready")
    t_up = time.monotonic()
    scene.queue("premium", 0)
    t_quiet = time.monotonic()
    t_settled = scene.settle()
    samples = scene.samples
    return {
        "to_hpa_s": first_at(samples, t0, lambda s: (s.hpa_desired or 0) >= MAX_REPLICAS),
        "to_spec_s": first_at(samples, t0, lambda s: (s.spec_replicas or 0) >= MAX_REPLICAS),
        "to_statefulset_s": first_at(samples, t0, lambda s: (s.sts_replicas or 0) >= MAX_REPLICAS),
        "to_ready_s": first_at(samples, t0, lambda s: s.pods_ready >= MAX_REPLICAS),
        "max_spec_replicas": extreme(samples, t0, t_up, lambda s: s.spec_replicas),
        "base_tenant_not_ready_s": not_ready_seconds(samples, t0, t_settled, BASE_TENANT),
        "base_tenant_reasons": reasons_seen(samples, t0, t_settled, BASE_TENANT),
        "scale_in_spec_s": first_at(samples, t_quiet, lambda s: s.spec_replicas == MIN_REPLICAS),
        "scale_in_statefulset_s": first_at(samples, t_quiet, lambda s: s.sts_replicas == MIN_REPLICAS),
    }


def phase_best_effort_burst(scene: Scene, window: float, prometheus: PrometheusServer) -> dict[str, Any]:
    scene.settle()
    t0 = time.monotonic()
    scene.queue("basic", BURST)
    time.sleep(window)
    t_end = time.monotonic()
    # What KEDA's basic trigger reads now: the rendered (clamped) query, evaluated by Prometheus.
    basic = next(t for t in scene_triggers(scene, prometheus.url) if t.name == "queue-basic")
    clamped = [float(r["value"][1]) for r in prometheus.query(basic.query)]
    scene.queue("basic", 0)
    scene.settle()
    samples = scene.samples
    return {
        "max_hpa_desired": extreme(samples, t0, t_end, lambda s: s.hpa_desired),
        "max_spec_replicas": extreme(samples, t0, t_end, lambda s: s.spec_replicas),
        "max_statefulset_replicas": extreme(samples, t0, t_end, lambda s: s.sts_replicas),
        "max_ready_pods": extreme(samples, t0, t_end, lambda s: s.pods_ready),
        "to_cap_s": first_at(samples, t0, lambda s: s.pods_ready >= BEST_EFFORT_CAP),
        "basic_signal": clamped[0] if clamped else None,
        "window_s": round(t_end - t0, 1),
        "samples": sum(t0 <= s.t <= t_end for s in samples),
    }


def scene_triggers(scene: Scene, prometheus_url: str) -> list[Any]:
    autoscaling = PoolAutoscaling.model_validate(autoscaling_spec(prometheus_url))
    return build_triggers(scene.namespace, MD, autoscaling)


def phase_floor(scene: Scene, stabilization: int, hold: float, reset: bool = True) -> dict[str, Any]:
    floor = 2
    scene.settle()
    scene.create_tenant(FLOOR_TENANT, "standard")
    t_created = time.monotonic()
    scene.wait(
        lambda s: (
            s.tenants_ready.get(FLOOR_TENANT, False)
            and s.floor == floor
            and s.hpa_min == floor
            and s.pods_ready >= floor
        ),
        "the standard tenant Ready and the floor at 2",
    )
    admitted_s = round(time.monotonic() - t_created, 2)
    scene.queue("premium", BURST)
    scene.wait(lambda s: s.pods_ready == MAX_REPLICAS and s.sts_replicas == MAX_REPLICAS, "4 engines Ready")
    scene.queue("premium", 0)
    t_quiet = time.monotonic()
    # Long enough for the HPA to act on the quiet signals (its stabilization, or 300 s by default), then hold.
    window = (stabilization or DEFAULT_STABILIZATION_S) + hold
    time.sleep(window)
    t_end = time.monotonic()
    samples = scene.samples
    result = {
        "floor_replicas": floor,
        "tenant_admitted_s": admitted_s,
        "window_s": round(t_end - t_quiet, 1),
        "min_hpa_desired": extreme(samples, t_quiet, t_end, lambda s: s.hpa_desired, min),
        "min_hpa_min_replicas": extreme(samples, t_quiet, t_end, lambda s: s.hpa_min, min),
        "min_spec_replicas": extreme(samples, t_quiet, t_end, lambda s: s.spec_replicas, min),
        "min_statefulset_replicas": extreme(samples, t_quiet, t_end, lambda s: s.sts_replicas, min),
        "min_ready_pods": extreme(samples, t_quiet, t_end, lambda s: s.pods_ready, min),
        "to_floor_spec_s": first_at(samples, t_quiet, lambda s: s.spec_replicas == floor),
        "to_floor_statefulset_s": first_at(samples, t_quiet, lambda s: s.sts_replicas == floor),
        "samples": sum(t_quiet <= s.t <= t_end for s in samples),
    }
    if reset:
        scene.delete_tenant(FLOOR_TENANT)
        scene.wait(lambda s: s.floor == 1 and FLOOR_TENANT not in s.tenants_ready, "the floor back at 1")
        scene.settle()
    return result


def fill_gpus(scene: Scene) -> list[str]:
    """A filler pod on every pool node with free GPUs; their names."""
    nodes = [
        n
        for n in (scene.get(f"/api/v1/nodes?labelSelector={GPU_POOL_LABEL}") or {}).get("items") or []
        if not n["metadata"].get("deletionTimestamp")
    ]
    pods = (scene.get("/api/v1/pods") or {}).get("items") or []
    names = []
    for node, gpus in sorted(free_gpus(nodes, pods).items()):
        if gpus > 0:
            pod = scene.create(
                f"/api/v1/namespaces/{scene.namespace}/pods", filler_pod(scene.namespace, node, gpus)
            )
            names.append(pod["metadata"]["name"])
    return names


def phase_pending(scene: Scene, round_index: int) -> dict[str, Any]:
    scene.settle()
    fillers = fill_gpus(scene)
    created: dict[str, float] = {}
    for name, tier in WAITING:
        scene.create_tenant(name, tier)
        created[name] = time.monotonic()
        time.sleep(1.2)  # creation timestamps have a resolution of one second: one apart each
    waiting = [n for n, _ in WAITING]
    t_waiting = scene.wait(
        lambda s: (
            all(s.tenants_reason.get(n) == "WaitingForCapacity" for n in waiting)
            and s.sts_replicas == MAX_REPLICAS
            and s.pods_pending == MAX_REPLICAS - 1
        ),
        "the three tenants WaitingForCapacity and 3 engine pods Pending",
    )
    state = scene.latest()
    waiting_message = str(
        condition(scene.get(f"{API}/namespaces/{scene.namespace}/tenants/{waiting[-1]}") or {}).get("message")
    )
    before = {
        "floor": state.floor,
        "hpa_min": state.hpa_min,
        "spec_replicas": state.spec_replicas,
        "statefulset_replicas": state.sts_replicas,
        "pods_pending": state.pods_pending,
        "waiting_s": round(t_waiting - created[waiting[-1]], 2),
        "in_table": sorted(scene.table_tenants() & set(waiting)),  # target: none
        "admitted": sorted(state.tenants_admitted & set(waiting)),  # target: none
    }
    in_table: dict[str, float | None] = dict.fromkeys(waiting)
    nodes: list[tuple[str, float]] = []  # (name, created at)
    node_ready: dict[str, float | None] = {}
    for k in range(1, MAX_REPLICAS):
        name = f"gpu-shared-arrive-{round_index}-{k}"
        scene.create("/api/v1/nodes", build_node_manifest(arriving_node(name)))
        t_node = time.monotonic()
        nodes.append((name, t_node))
        node_ready[name] = None
        deadline = t_node + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            if (
                node_ready[name] is None
                and condition(scene.get(f"/api/v1/nodes/{name}") or {}).get("status") == "True"
            ):
                node_ready[name] = round(time.monotonic() - t_node, 2)
            table = scene.table_tenants()
            now = time.monotonic()
            for n in waiting:
                if in_table[n] is None and n in table:
                    in_table[n] = now
            admitted = scene.latest().tenants_admitted
            if (
                sum(v is not None for v in in_table.values()) >= k
                and len(admitted & set(waiting)) >= k
                and scene.latest().pods_ready >= k + 1
            ):
                break
            time.sleep(0.1)
    t_ready = scene.wait(
        lambda s: all(s.tenants_ready.get(n, False) for n in [*waiting, BASE_TENANT]),
        "every tenant Ready",
    )
    samples = scene.samples
    t_first = nodes[0][1]

    def first(check: Callable[[Sample], bool]) -> float | None:
        return next((s.t for s in samples if s.t >= t_first and check(s)), None)

    status_at = {n: first(tenant_admitted(n)) for n in waiting}
    ready_at = {n: first(tenant_ready(n)) for n in waiting}

    def its_node(t: float | None) -> tuple[str, float] | None:
        """The last node created before ``t``: the capacity that admitted a tenant at ``t``."""
        before_t = [x for x in nodes if t is not None and x[1] <= t]
        return before_t[-1] if before_t else None

    def after_its_node(at: Mapping[str, float | None]) -> dict[str, float]:
        return {n: round(t - node[1], 2) for n, t in at.items() if t is not None and (node := its_node(t))}

    result: dict[str, Any] = {
        "before": before,
        "order": admission_order(in_table),
        "order_by_status": admission_order(status_at),
        "admitted_by_node": {n: (its_node(t) or ("", 0.0))[0] for n, t in in_table.items()},
        "nodes": [
            {
                "node": name,
                "node_ready_s": node_ready[name],
                "pod_ready_s": first_at(samples, t_node, ready_at_least(k + 2)),
            }
            for k, (name, t_node) in enumerate(nodes)
        ],
        "in_table_s": after_its_node(in_table),
        "admitted_s": after_its_node(status_at),
        "ready_after_its_node_s": {
            n: round(t - node[1], 2)
            for n, t in ready_at.items()
            if t is not None and (node := its_node(in_table[n]))
        },
        "ready_after_last_node_s": {n: round(t - nodes[-1][1], 2) for n, t in ready_at.items() if t},
        "all_ready_after_last_node_s": round(t_ready - nodes[-1][1], 2),
        "base_tenant_not_ready_s": not_ready_seconds(samples, created[waiting[0]], t_ready, BASE_TENANT),
        "base_tenant_reasons": reasons_seen(samples, created[waiting[0]], t_ready, BASE_TENANT),
        "waiting_message": waiting_message,
    }
    for name in waiting:
        scene.delete_tenant(name)
    for pod in fillers:
        scene.delete(f"/api/v1/namespaces/{scene.namespace}/pods/{pod}")
    scene.wait(lambda s: s.floor == 1 and not set(waiting) & set(s.tenants_ready), "the floor back at 1")
    scene.settle()
    for name, _ in nodes:
        scene.delete(f"/api/v1/nodes/{name}")
    return result


# --- the run ---------------------------------------------------------------------------------------------


def served(plane: ControlPlane, namespace: str) -> bool:
    return all(
        plane.request("GET", f"{API}/namespaces/{namespace}/{p}")[0] == 200
        for p in ("tenants", "modeldeployments")
    )


def until(check: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def hpa_stabilization(hpa: Obj) -> int | None:
    """The HPA's scale-down stabilization window as its spec says (``None``: Kubernetes' default, 300 s)."""
    scale_down = ((hpa.get("spec") or {}).get("behavior") or {}).get("scaleDown") or {}
    window = scale_down.get("stabilizationWindowSeconds")
    return None if window is None else int(window)


def set_stabilization(scene: Scene, seconds: int) -> None:
    """Set (``seconds`` > 0) or remove (0) the ScaledObject's scale-down stabilization, and wait until KEDA
    carried it to the HPA and the HPA reads its metrics."""
    status, body = scene.plane.request(
        "PATCH",
        f"{scene.so_path}?fieldManager={FIELD_MANAGER}",
        scale_down_behavior(seconds) if seconds else {"spec": {"advanced": None}},
        content_type="application/merge-patch+json",
    )
    if status != 200:
        raise RuntimeError(f"patching the ScaledObject's behavior: {status} {body}")

    def carried() -> bool:
        hpa = scene.get(scene.hpa_path)
        if hpa is None or condition(hpa, "ScalingActive").get("status") != "True":
            return False
        window = hpa_stabilization(hpa)
        return window == seconds if seconds else window in (None, DEFAULT_STABILIZATION_S)

    until(carried, f"the HPA with a scale-down stabilization of {seconds or DEFAULT_STABILIZATION_S} s")


def setup(scene: Scene, stabilization: int) -> dict[str, float]:
    """The ScaledObject, its HPA (with the benchmark's scale-down stabilization), the pool at 1 and the base
    tenant Ready; how long each took."""
    t0 = time.monotonic()
    times: dict[str, float] = {}
    until(lambda: scene.get(scene.so_path), "the ScaledObject")
    times["scaled_object_s"] = round(time.monotonic() - t0, 1)
    set_stabilization(scene, stabilization)
    times["hpa_s"] = round(time.monotonic() - t0, 1)
    scene.create_tenant(BASE_TENANT, "premium")
    scene.wait(
        lambda s: s.tenants_ready.get(BASE_TENANT, False) and s.pods_ready == 1, "the base tenant Ready"
    )
    times["base_tenant_ready_s"] = round(time.monotonic() - t0, 1)
    return times


def summarize(rounds: Sequence[Mapping[str, Any]], stabilization: int, drain: float) -> dict[str, Figure]:
    figures: dict[str, Figure] = {}

    def add(key: str, values: Sequence[float | None], unit: str, note: str = "") -> None:
        fig = spread_of(values, unit, note)
        if fig is not None:
            figures[key] = fig

    p1 = [r["premium_burst"] for r in rounds if "premium_burst" in r]
    for key in ("to_hpa_s", "to_spec_s", "to_statefulset_s", "to_ready_s"):
        add(f"premium_burst.{key}", [r[key] for r in p1], "s", f"1 → {MAX_REPLICAS} replicas")
    add("premium_burst.base_tenant_not_ready_s", [r["base_tenant_not_ready_s"] for r in p1], "s")
    scale_in = f"stabilization {stabilization} s" if stabilization else "HPA default stabilization"
    add("premium_burst.scale_in_spec_s", [r["scale_in_spec_s"] for r in p1], "s", scale_in)
    add(
        "premium_burst.scale_in_statefulset_s",
        [r["scale_in_statefulset_s"] for r in p1],
        "s",
        f"{scale_in}, drain {drain:g} s",
    )
    p2 = [r["best_effort_burst"] for r in rounds if "best_effort_burst" in r]
    cap = f"cap {BEST_EFFORT_CAP}"
    for key in ("max_hpa_desired", "max_spec_replicas", "max_statefulset_replicas", "max_ready_pods"):
        add(f"best_effort_burst.{key}", [r[key] for r in p2], "replicas", cap)
    add("best_effort_burst.to_cap_s", [r["to_cap_s"] for r in p2], "s")
    add(
        "best_effort_burst.basic_signal",
        [r["basic_signal"] for r in p2],
        "requests",
        f"queue {BURST}, clamped",
    )
    add("best_effort_burst.window_s", [r["window_s"] for r in p2], "s")
    p3 = [r["floor"] for r in rounds if "floor" in r]
    floor_note = "floor 2"
    for key in ("min_hpa_desired", "min_spec_replicas", "min_statefulset_replicas", "min_ready_pods"):
        add(f"floor.{key}", [r[key] for r in p3], "replicas", floor_note)
    add("floor.to_floor_spec_s", [r["to_floor_spec_s"] for r in p3], "s", scale_in)
    add(
        "floor.to_floor_statefulset_s",
        [r["to_floor_statefulset_s"] for r in p3],
        "s",
        f"{scale_in}, drain {drain:g} s",
    )
    add("floor.window_s", [r["window_s"] for r in p3], "s")
    p4 = [r["pending"] for r in rounds if "pending" in r]
    for name, _tier in WAITING:
        add(f"pending.in_table_s.{name}", [r["in_table_s"].get(name) for r in p4], "s", "after its node")
        add(f"pending.admitted_s.{name}", [r["admitted_s"].get(name) for r in p4], "s", "after its node")
        add(
            f"pending.ready_after_last_node_s.{name}",
            [r["ready_after_last_node_s"].get(name) for r in p4],
            "s",
        )
    add("pending.node_ready_s", [n["node_ready_s"] for r in p4 for n in r["nodes"]], "s")
    add("pending.pod_ready_s", [n["pod_ready_s"] for r in p4 for n in r["nodes"]], "s")
    add("pending.base_tenant_not_ready_s", [r["base_tenant_not_ready_s"] for r in p4], "s")
    if p4:
        in_order = sum(r["order"] == EXPECTED_ORDER for r in p4)
        figures["pending.rounds_in_expected_order"] = Figure.single(in_order, "rounds", note=f"of {len(p4)}")
    return figures


def without_keep_logs(argv: Sequence[str]) -> list[str]:
    """The command as recorded: ``--keep-logs DIR`` (where this machine's logs went) changes no figure."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--keep-logs":
            skip = True
        elif not arg.startswith("--keep-logs="):
            out.append(arg)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phases", default="1,2,3,4", help="which phases each round runs (comma-separated)")
    parser.add_argument(
        "--scale-down-stabilization", type=int, default=15, help="seconds; 0: the HPA's default"
    )
    parser.add_argument("--drain-seconds", type=float, default=10)
    parser.add_argument("--best-effort-window", type=float, default=30)
    parser.add_argument(
        "--floor-hold", type=float, default=30, help="seconds watched beyond the stabilization"
    )
    parser.add_argument(
        "--default-stabilization-floor",
        action="store_true",
        help="after the rounds, the floor phase once more at the HPA's default stabilization (300 s)",
    )
    parser.add_argument("--keep-logs", type=Path, help="copy the logs here at the end")
    add_results_argument(parser, NAME)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop everything on the way out
    phases = {int(p) for p in args.phases.split(",")}
    loads = [os.getloadavg()[0]]
    started = time.monotonic()
    layout = build_layout(shared_nodes=MAX_REPLICAS, gpus_per_node=GPUS_PER_NODE, dedicated={})
    plane = start_control_plane("full", layout=layout, timeout=300)
    keda: Keda | None = None
    prometheus: PrometheusServer | None = None
    operator: OperatorReplica | None = None
    scene: Scene | None = None
    rounds: list[dict[str, Any]] = []
    setup_times: dict[str, float] = {}
    default_floor: dict[str, Any] | None = None
    failure = ""
    try:
        keda = start_keda(plane)
        apply_crds(plane)
        namespace = create_namespace(plane, "autoscale")
        deadline = time.monotonic() + 60
        while not served(plane, namespace) and time.monotonic() < deadline:
            time.sleep(0.2)
        with serving_gateway_metrics() as (metrics, port):
            prometheus = start_prometheus(scrape_config(namespace, port))
            scene = Scene(plane, namespace, metrics)
            scene.quiet()
            scene.create(
                f"{API}/namespaces/{namespace}/modeldeployments", model_deployment(namespace, prometheus.url)
            )
            log_dir = plane.workdir / "operator"
            log_dir.mkdir(parents=True, exist_ok=True)
            operator = OperatorReplica(
                plane,
                namespace,
                "autoscaling-bench",
                log_dir,
                env={
                    "KVFLEET_EXPOSURE_KINDS": "ScaledObject",
                    "KVFLEET_DRAIN_SECONDS": str(args.drain_seconds),
                },
                resync_seconds=30,
                leader_election=False,
            )
            operator.start()
            scene.start_sampling()
            setup_times = setup(scene, args.scale_down_stabilization)
            loads.append(os.getloadavg()[0])
            print(
                json.dumps({"setup": setup_times, "seconds": round(time.monotonic() - started, 1)}),
                flush=True,
            )
            for i in range(args.rounds):
                result: dict[str, Any] = {}
                try:
                    if 1 in phases:
                        result["premium_burst"] = phase_premium_burst(scene)
                    if 2 in phases:
                        result["best_effort_burst"] = phase_best_effort_burst(
                            scene, args.best_effort_window, prometheus
                        )
                    if 3 in phases:
                        result["floor"] = phase_floor(scene, args.scale_down_stabilization, args.floor_hold)
                    if 4 in phases:
                        result["pending"] = phase_pending(scene, i)
                except (TimeoutError, RuntimeError) as exc:
                    failure = f"round {i + 1}: {exc}"
                    print(json.dumps({"round": i + 1, "failed": str(exc)}), flush=True)
                rounds.append(result)
                loads.append(os.getloadavg()[0])
                print(json.dumps({"round": i + 1, **result}, default=str), flush=True)
                if failure:
                    break
            if args.default_stabilization_floor and not failure and args.scale_down_stabilization:
                try:
                    scene.settle()
                    set_stabilization(scene, 0)
                    default_floor = phase_floor(scene, 0, args.floor_hold, reset=False)
                    print(json.dumps({"floor_default_stabilization": default_floor}), flush=True)
                except (TimeoutError, RuntimeError) as exc:
                    failure = f"floor at the default stabilization: {exc}"
                    print(json.dumps({"failed": failure}), flush=True)
    finally:
        if scene is not None:
            scene.stop_sampling()
        if operator is not None:
            operator.terminate()
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            folders = [
                plane.workdir / "logs",
                plane.workdir / "operator",
                *([keda.workdir / "logs"] if keda else []),
            ]
            for log in [p for folder in folders for p in folder.glob("*.log")]:
                shutil.copy(log, args.keep_logs / f"{log.parent.name}-{log.name}")
        if prometheus is not None:
            prometheus.stop()
        if keda is not None:
            keda.stop(remove_crds=False)
        plane.stop()
    figures = summarize(rounds, args.scale_down_stabilization, args.drain_seconds)
    if default_floor is not None:
        note = f"floor 2, HPA default stabilization {DEFAULT_STABILIZATION_S} s"
        for key in ("min_hpa_desired", "min_spec_replicas", "min_statefulset_replicas", "min_ready_pods"):
            if default_floor[key] is not None:
                figures[f"floor_default.{key}"] = Figure.single(default_floor[key], "replicas", note=note)
        for key in ("to_floor_spec_s", "window_s"):
            if default_floor[key] is not None:
                figures[f"floor_default.{key}"] = Figure.single(default_floor[key], "s")
    if not figures:
        print(f"nothing measured: {failure}", file=sys.stderr)
        return 1
    details: dict[str, Any] = {
        "rounds": json.loads(json.dumps(rounds, default=str)),
        "floor_default_stabilization": default_floor,
        "setup": setup_times,
        "settings": {
            "nodes": MAX_REPLICAS,
            "gpus_per_node": GPUS_PER_NODE,
            "gpus_per_replica": GPUS_PER_NODE,
            "min_replicas": MIN_REPLICAS,
            "max_replicas": MAX_REPLICAS,
            "best_effort_max_replicas": BEST_EFFORT_CAP,
            "queue_per_replica": QUEUE_PER_REPLICA,
            "burst_queue": BURST,
            "seats_per_replica": SEATS_PER_REPLICA,
            "scale_down_stabilization_s": args.scale_down_stabilization,
            "drain_s": args.drain_seconds,
            "best_effort_window_s": args.best_effort_window,
            "floor_hold_s": args.floor_hold,
            "sample_s": SAMPLE_S,
            "expected_order": EXPECTED_ORDER,
        },
        "failure": failure,
        "sampler_errors": scene.errors[:20] if scene else [],
        "wall_s": round(time.monotonic() - started, 1),
    }
    run = measured(
        NAME,
        command_line(without_keep_logs(sys.argv), prefix="PYTHONPATH=hack:tests:tests/cluster"),
        figures,
        Machine.over_phases(loads),
        details,
    )
    write_results(run, args.results)
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
