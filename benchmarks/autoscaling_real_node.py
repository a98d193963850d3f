"""Autoscaling on the real node: a premium load step scales a CPU pool out through KEDA, and back in.

    PYTHONPATH=hack .venv/bin/python benchmarks/autoscaling_real_node.py [--cycles 2]

11 minutes with ``--cycles 1`` on 2 cores (setup 2 minutes, the cycle 9); each further cycle about 9 more.
Run it under ``flock /tmp/kvfleet-bench.lock`` beside other sessions.

Needs root, the node tier's binaries, the images of the current tree and the tiny model (what
``tests/e2e/test_real_node.py`` needs, :func:`devcluster.realpods.real_pods_blockers`) and KEDA
(``hack/provision.d/35-keda.sh``). Everything is real: the control plane plus a real kubelet on containerd
(``node`` tier), KEDA's operator and metrics API server built from Go (:mod:`devcluster.keda`), a
Prometheus that discovers the pods through the API server and scrapes the gateway and engine pods every
second, and the chart installed with helm with ``rbac.keda=true`` and a short
``operator.scaleInDrainSeconds`` (``--drain-seconds``). examples/local's CPU ModelDeployment (vLLM-CPU +
LMCache, the tiny model) is applied with ``spec.pool.autoscaling`` min 1 max 2 on the premium queue alone
(2 queued premium requests per replica; the other tiers' queues and KV use off) and
``spec.gateway.engineInFlightPerReplica`` 1, so a modest load queues at the gateway.

The ScaledObject the operator renders carries no ``advanced.horizontalPodAutoscalerConfig`` (the API has
no field for it), so the HPA would wait its default 300 s scale-down stabilization before any scale-in.
The benchmark patches the live ScaledObject with ``--scale-down-window`` seconds as a platform team would
(a field manager of its own: the operator's server-side apply leaves fields it does not own alone) and
records whether the patch was still there at the end; ``--scale-down-window 0`` leaves the default. The
window must outlast an engine's start: the queue drains while the new replica starts (the first replica
keeps serving), and with 30 s the HPA cancelled the scale-out before the pod was Ready; 180 s by default.

Each engine pod is capped at ``--engine-cpu-limit`` CPUs (700m by default): the node's 2 cores also run
the control plane, KEDA, Prometheus, the operator and the gateway, and uncapped, vLLM-CPU's start and its
busy worker took them all (the operator lost its leader lease and exited, the gateway failed its liveness
probe and was restarted with requests on it). In a cluster the engines have nodes of their own.

Calibration: the time one request takes alone (``ignore_eos``, so every answer has the same length);
``max_tokens`` is chosen so that it is about ``--request-seconds``, and one replica's capacity is then one
request per that time (one seat). Open-loop load (Poisson arrivals, whatever the answers; alternating
between the two premium tenants ``premium`` and ``premium-b``, so that neither reaches the gateway's
per-tenant bound of 64 waiting requests) through the gateway's Service, then ``--cycles`` times:

1. **steady**: ``--steady-load`` of one replica's capacity for ``--steady-seconds``; the pool stays at 1;
2. **step**: ``--step-load`` of one replica's capacity. Measured from the step: the HPA raising
   ``spec.pool.replicas`` to 2, the operator's StatefulSet at 2, the second engine pod created and Ready,
   the tenant table (the ``<md>-tenants`` ConfigMap) listing it, the gateway pod reloading that table and
   checking the replica healthy (its ``kvfleet_gateway_config_reloads_total`` and
   ``kvfleet_gateway_replica_healthy``, read from the pod), and the second replica **serving**: the first
   request it answered (its own ``vllm:request_success_total``, read from the pod). The step lasts until
   then plus ``--hold-seconds``;
3. **down**: back to the steady load. Measured from the load going down: the HPA writing 1, the table
   dropping the leaving replica (the drain starts), the gateway reloading it, the last request the leaving
   replica answered, the StatefulSet at 1 and the pod gone.

The table refresh (ConfigMap written → the gateway pod reloaded it) is measured on both changes of every
cycle: the kubelet rewrites a mounted ConfigMap when it next syncs the pod, every ``syncFrequency`` (1 min)
plus up to half of it of jitter, so up to 90 s; ``--drain-seconds`` 100 covers that, the gateway's 1 s
reload and the longest answer with a few seconds to spare.

Every request's outcome is kept (status code, or the exception: reset, timeout); a failure is anything but
a 200 with choices. Failures are counted per phase of each cycle (steady, scale-out = the step phase,
scale-in = the down phase until the leaving pod is gone); each failed request is listed in the results'
``details`` with its time and answer, and the gateway's warnings and errors (``kubectl logs``) beside them.
Figures are medians over the cycles with their range.
Results: ``benchmarks/results/autoscaling_real_node.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import json
import os
import random
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/: the results format

from devcluster import start_control_plane  # noqa: E402
from devcluster.keda import missing_keda, start_keda  # noqa: E402
from devcluster.prometheus import start_prometheus  # noqa: E402
from devcluster.realpods import (  # noqa: E402
    PROMETHEUS_K8S,
    RESTRICTED,
    KubeError,
    build_example_documents,
    build_pod_discovery_config,
    create_namespace,
    create_scraper_identity,
    gateway_service_url,
    helm_install,
    kube,
    kubectl,
    provide_model_volume,
    real_pods_blockers,
    tenant_keys,
    wait_for_engine_and_gateway,
)
from results_format import (  # noqa: E402
    Figure,
    Machine,
    add_results_argument,
    command_line,
    measured,
    name_of,
    write_results,
)

NAME = "autoscaling_real_node"
NS = "kvfleet-bench-autoscaling"
MONITORING_NS = "monitoring"
MD = "tiny"
ENGINE = f"{MD}-engine"
#: The replica the step adds and the scale-in removes (the StatefulSet's second ordinal).
SECOND = f"{ENGINE}-1"
SCALED_OBJECT = ENGINE  # build/autoscaling.py: scaled_object_name
HPA = f"keda-hpa-{SCALED_OBJECT}"
TENANTS = ("premium", "premium-b")
GATEWAY_METRICS_PORT = 8081  # kvfleet_runtime.config.GATEWAY_METRICS_PORT
ENGINE_METRICS_PORT = 8001  # kvfleet_runtime.config.PLUGIN_METRICS_PORT (re-exports vLLM's series)
RELOADS = "kvfleet_gateway_config_reloads_total"
REPLICA_HEALTHY = "kvfleet_gateway_replica_healthy"
QUEUE_DEPTH = "kvfleet_gateway_engine_queue_depth"
UPSTREAM_ERRORS = "kvfleet_gateway_upstream_errors_total"
SERVED = "vllm:request_success_total"
#: Queued premium requests per replica (the ScaledObject's threshold) and seats per replica.
PREMIUM_PER_REPLICA = 2
IN_FLIGHT_PER_REPLICA = 1
#: The engine pods' CPU request (the scheduler's view only: the engines share the node's cores anyway).
ENGINE_CPU_REQUEST = "500m"
#: The gateway's CPU request (its share of the cores when the engines want them all).
GATEWAY_CPU_REQUEST = "250m"
#: How long a request may wait at the gateway (spec.gateway.queueTimeout) and at the client: a queue
#: while the second replica starts is the point, not a failure; the client waits longer than the gateway.
QUEUE_TIMEOUT = "5m"
CLIENT_TIMEOUT_S = 420.0
POLL_S = 1.0
KMD = f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/modeldeployments/{MD}"
KSTS = f"/apis/apps/v1/namespaces/{NS}/statefulsets/{ENGINE}"
KCM = f"/api/v1/namespaces/{NS}/configmaps/{MD}-tenants"
KSO = f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects/{SCALED_OBJECT}"
KHPA = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/{HPA}"
PROMPT = "Tell the story of the cache that scaled out and back in again, one replica at a time."


# --- pure parts ---------------------------------------------------------------------------------------------


def autoscaling_spec(prometheus_url: str) -> dict[str, Any]:
    """spec.pool.autoscaling: 1..2 replicas on the premium queue alone, read every 2 s."""
    return {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 2,
        "prometheusAddress": prometheus_url,
        "pollingIntervalSeconds": 2,
        "signals": {
            "queuePerReplica": {"premium": PREMIUM_PER_REPLICA, "standard": 0, "basic": 0},
            "kvUsage": 0,
        },
    }


def bench_documents(
    docs: Sequence[Mapping[str, Any]], prometheus_url: str, engine_cpu_limit: str = ""
) -> list[dict[str, Any]]:
    """examples/local's documents (as :func:`devcluster.realpods.build_example_documents` renders them)
    with autoscaling on, one seat per replica, a long queue timeout and a second premium tenant; each
    engine pod capped at ``engine_cpu_limit`` CPUs when given."""
    out = []
    for original in docs:
        doc = copy.deepcopy(dict(original))
        if doc["kind"] == "ModelDeployment":
            pool = doc["spec"]["pool"]
            pool.pop("replicas", None)  # KEDA's HPA owns it
            pool["autoscaling"] = autoscaling_spec(prometheus_url)
            # A CPU engine requests 1 CPU by default: two would not fit on a 2-core node beside the rest.
            resources: dict[str, Any] = {"requests": {"cpu": ENGINE_CPU_REQUEST}}
            if engine_cpu_limit:
                resources["limits"] = {"cpu": engine_cpu_limit}
            pool["podTemplate"] = {"resources": resources}
            gateway = doc["spec"].setdefault("gateway", {})
            gateway["engineInFlightPerReplica"] = IN_FLIGHT_PER_REPLICA
            gateway["queueTimeout"] = QUEUE_TIMEOUT
            gateway["resources"] = {"requests": {"cpu": GATEWAY_CPU_REQUEST, "memory": "128Mi"}}
        out.append(doc)
        if doc["kind"] == "Tenant" and doc["metadata"]["name"] == TENANTS[0]:
            second = copy.deepcopy(doc)
            second["metadata"]["name"] = TENANTS[1]
            second["spec"]["kvQuota"]["hbm"] = "20%"  # the pool's guarantees stay within 100%
            out.append(second)
    return out


def behavior_patch(window_s: int) -> dict[str, Any]:
    """The ScaledObject's HPA behaviour: scale-down stabilization of ``window_s`` seconds."""
    scale_down = {
        "stabilizationWindowSeconds": window_s,
        "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
    }
    return {"spec": {"advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": scale_down}}}}}


_LABELS = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of ``name`` in Prometheus' text format: (labels, value)."""
    found = []
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name) :]
        if rest[:1] not in ("{", " "):
            continue
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            inner, _, rest = rest[1:].partition("}")
            labels = dict(_LABELS.findall(inner))
        with contextlib.suppress(ValueError, IndexError):
            found.append((labels, float(rest.split()[0])))
    return found


def metric_sum(text: str, name: str, **match: str) -> float:
    return sum(
        v for labels, v in metric_values(text, name) if all(labels.get(k) == x for k, x in match.items())
    )


@dataclass
class Sample:
    """What the observer saw at one moment (``t``: epoch seconds)."""

    t: float
    md_replicas: int | None = None
    sts_replicas: int | None = None
    draining: bool = False
    endpoints: int | None = None
    #: engine pod -> "ready" | "starting" | "terminating"
    engines: dict[str, str] = field(default_factory=dict)
    #: engine pod -> requests it answered (its own vLLM counter)
    served: dict[str, float] = field(default_factory=dict)
    gw_reloads: float | None = None
    gw_queue_premium: float | None = None
    gw_upstream_errors: float | None = None
    #: replica URL -> 1 healthy / 0 not, as the gateway's table lists them
    gw_healthy: dict[str, float] = field(default_factory=dict)


def _first(samples: Sequence[Sample], since: float, pred: Callable[[Sample], bool]) -> float | None:
    return next((s.t for s in samples if s.t >= since and pred(s)), None)


def reload_after(samples: Sequence[Sample], change: float | None) -> float | None:
    """When the gateway reloaded its table after it changed at ``change`` (first sample whose reload
    counter is above the last one seen before the change)."""
    if change is None:
        return None
    before = [s.gw_reloads for s in samples if s.t < change and s.gw_reloads is not None]
    if not before:
        return None
    base = before[-1]
    return _first(samples, change, lambda s: s.gw_reloads is not None and s.gw_reloads > base)


def _is_second(url: str) -> bool:
    return url.startswith(f"http://{SECOND}.")


def scale_out_events(samples: Sequence[Sample], step: float) -> dict[str, float | None]:
    """Epoch times of the scale-out's steps after the load step at ``step`` (``None``: not seen)."""
    table = _first(samples, step, lambda s: (s.endpoints or 0) >= 2)
    return {
        "hpa": _first(samples, step, lambda s: (s.md_replicas or 0) >= 2),
        "statefulset": _first(samples, step, lambda s: (s.sts_replicas or 0) >= 2),
        "pod_created": _first(samples, step, lambda s: SECOND in s.engines),
        "pod_ready": _first(samples, step, lambda s: s.engines.get(SECOND) == "ready"),
        "table": table,
        "gateway_reloaded": reload_after(samples, table),
        "gateway_healthy": _first(
            samples, step, lambda s: any(_is_second(u) and v == 1 for u, v in s.gw_healthy.items())
        ),
        "serving": _first(samples, step, lambda s: s.served.get(SECOND, 0) > 0),
    }


def scale_in_events(samples: Sequence[Sample], down: float) -> dict[str, float | None]:
    """Epoch times of the scale-in's steps after the load went down at ``down``."""
    table = _first(samples, down, lambda s: s.endpoints == 1)
    terminating = _first(samples, down, lambda s: s.engines.get(SECOND) == "terminating")
    sts = _first(samples, down, lambda s: s.sts_replicas == 1)
    gone_from = terminating or sts
    last_served = None
    previous = None
    for s in samples:
        count = s.served.get(SECOND)
        if s.t >= down and count is not None and previous is not None and count > previous:
            last_served = s.t
        if count is not None:
            previous = count
    return {
        "hpa": _first(samples, down, lambda s: s.md_replicas == 1),
        "table": table,
        "gateway_reloaded": reload_after(samples, table),
        "last_answer_on_leaving": last_served,
        "statefulset": sts,
        "pod_terminating": terminating,
        "pod_gone": None
        if gone_from is None
        else _first(samples, gone_from, lambda s: SECOND not in s.engines),
    }


@dataclass
class Outcome:
    """One request: when it was sent and answered (epoch s), by which tenant, its HTTP status (0: no
    answer) and, unless it succeeded, what went wrong."""

    sent: float
    done: float
    tenant: str
    status: int
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error)


def outcomes_between(outcomes: Sequence[Outcome], start: float, end: float) -> list[Outcome]:
    return [o for o in outcomes if start <= o.sent < end]


def relative(events: Mapping[str, float | None], origin: float) -> dict[str, float | None]:
    return {k: None if v is None else round(v - origin, 1) for k, v in events.items()}


# --- the load -----------------------------------------------------------------------------------------------


class OpenLoop:
    """Poisson arrivals at ``rate`` requests/s (changed at any time by another thread), whatever the answers;
    every request is a completion of ``max_tokens`` tokens (``ignore_eos``) for the next tenant in turn."""

    def __init__(
        self, url: str, model: str, keys: Sequence[tuple[str, str]], max_tokens: int, seed: int
    ) -> None:
        self.url, self.model, self.keys, self.max_tokens = url, model, list(keys), max_tokens
        self.rate = 0.0
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self._rng = random.Random(seed)  # noqa: S311 - a reproducible workload, not a secret
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._run()), name="open-loop", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop sending and wait until every request sent has its outcome."""
        self._stop.set()
        self._thread.join(timeout=CLIENT_TIMEOUT_S + 30)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            rate, next_at, i = 0.0, float("inf"), 0
            while not self._stop.is_set():
                now = time.monotonic()
                if self.rate != rate:
                    rate = self.rate
                    next_at = now + self._rng.expovariate(rate) if rate > 0 else float("inf")
                if now >= next_at:
                    task = asyncio.create_task(self._one(session, i))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    i += 1
                    next_at += self._rng.expovariate(rate)
                    continue
                await asyncio.sleep(min(0.05, next_at - now))
            if tasks:
                await asyncio.gather(*tasks)

    async def _one(self, session: aiohttp.ClientSession, i: int) -> None:
        tenant, key = self.keys[i % len(self.keys)]
        body = {
            "model": self.model,
            # A different start each time: the gateway's affinity hash spreads the requests over replicas.
            "prompt": f"{secrets.token_hex(6)} {PROMPT}",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        headers = {"Authorization": f"Bearer {key}"}
        sent, status, error = time.time(), 0, ""
        self.in_flight += 1
        try:
            async with session.post(f"{self.url}/v1/completions", json=body, headers=headers) as resp:
                status, raw = resp.status, await resp.read()
                if status != 200:
                    error = raw[:400].decode(errors="replace")
                elif not json.loads(raw).get("choices"):
                    error = f"no choices: {raw[:200]!r}"
        except TimeoutError:
            error = f"client timeout after {CLIENT_TIMEOUT_S:.0f} s"
        except (aiohttp.ClientError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.in_flight -= 1
        self.outcomes.append(Outcome(sent=sent, done=time.time(), tenant=tenant, status=status, error=error))


def complete_once(url: str, model: str, key: str, max_tokens: int) -> float:
    """One completion on its own: seconds it took."""
    body = json.dumps({
        "model": model, "prompt": f"{secrets.token_hex(6)} {PROMPT}", "max_tokens": max_tokens,
        "ignore_eos": True, "temperature": 0,
    }).encode()  # fmt: skip
    req = urllib.request.Request(  # noqa: S310 - the gateway Service's http URL
        f"{url}/v1/completions",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as resp:  # noqa: S310 - http
        usage = json.loads(resp.read())["usage"]
    if usage["completion_tokens"] != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {usage}")
    return time.monotonic() - start


# --- watching the cluster -----------------------------------------------------------------------------------


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:  # noqa: S310 - pod metrics over http
            return str(resp.read().decode())
    except OSError:
        return None


class Observer:
    """Samples the ModelDeployment, StatefulSet, engine pods, tenant table, the gateway pod's metrics and
    each engine pod's request counter every :data:`POLL_S` seconds, in a thread."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="observer", daemon=True)
        self._pool = ThreadPoolExecutor(6, thread_name_prefix="observer")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._pool.shutdown(wait=False)

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def _get(self, path: str) -> Any:
        try:
            status, body = self.plane.request("GET", path, timeout=5)
        except OSError:
            return None
        return body if status == 200 else None

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            with contextlib.suppress(Exception):  # a sample lost is a sample lost; the next one comes
                self.samples.append(self.sample())
            self._stop.wait(max(0.0, POLL_S - (time.monotonic() - started)))

    def sample(self) -> Sample:
        """One sample: the API objects at once, then every pod's metrics at once (a slow metrics answer
        under load delays the sample, never the next request of the others)."""
        s = Sample(t=time.time())
        paths = (KMD, KSTS, KCM, f"/api/v1/namespaces/{NS}/pods")
        md, sts, cm, pod_list = self._pool.map(self._get, paths)
        if md:
            s.md_replicas = md["spec"]["pool"].get("replicas")
        if sts:
            s.sts_replicas = sts["spec"].get("replicas")
            s.draining = "kvfleet.io/drain" in (sts["metadata"].get("annotations") or {})
        if cm:
            table = json.loads(cm["data"]["tenants.json"])
            s.endpoints = len(table["pools"]["shared"]["endpoints"])
        scrapes: dict[str, str] = {}  # pod -> its metrics URL
        gateways: set[str] = set()
        for pod in (pod_list or {"items": []})["items"]:
            meta = pod["metadata"]
            name, component = meta["name"], meta.get("labels", {}).get("app.kubernetes.io/component")
            ip = (pod.get("status") or {}).get("podIP")
            if component == "engine":
                conditions = pod["status"].get("conditions") or []
                ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
                deleting = bool(meta.get("deletionTimestamp"))
                s.engines[name] = "terminating" if deleting else "ready" if ready else "starting"
                if ip:
                    scrapes[name] = f"http://{ip}:{ENGINE_METRICS_PORT}/metrics"
            elif component == "gateway" and ip and not meta.get("deletionTimestamp"):
                scrapes[name] = f"http://{ip}:{GATEWAY_METRICS_PORT}/metrics"
                gateways.add(name)
        texts = dict(zip(scrapes, self._pool.map(_get, scrapes.values()), strict=True))
        for name, text in texts.items():
            if text is None:
                continue
            if name not in gateways:
                s.served[name] = metric_sum(text, SERVED)
                continue
            s.gw_reloads = metric_sum(text, RELOADS)
            s.gw_queue_premium = metric_sum(text, QUEUE_DEPTH, sla_tier="premium")
            s.gw_upstream_errors = metric_sum(text, UPSTREAM_ERRORS)
            s.gw_healthy = {
                labels.get("replica", ""): v for labels, v in metric_values(text, REPLICA_HEALTHY)
            }
        return s


# --- the run ------------------------------------------------------------------------------------------------


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait_until(
    check: Callable[[], Any],
    what: str,
    timeout: float,
    show: Callable[[], str] | None = None,
    on_timeout: Callable[[], str] | None = None,
) -> Any:
    """``check()``'s first truthy answer, polled every second; ``show()`` printed every 30 s meanwhile;
    :class:`TimeoutError` after ``timeout`` s, with ``on_timeout()`` in its message."""
    deadline = time.monotonic() + timeout
    shown = time.monotonic()
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        if show is not None and time.monotonic() - shown >= 30:
            say(f"  waiting for {what}: {show()}")
            shown = time.monotonic()
        time.sleep(1.0)
    extra = f"\n{on_timeout()}" if on_timeout is not None else ""
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{extra}")


def progress(observer: Observer) -> str:
    """The latest sample in a line: what a human watching the run wants to see."""
    s = observer.latest()
    if s is None:
        return "no sample yet"
    return (
        f"md {s.md_replicas} sts {s.sts_replicas} table {s.endpoints} engines {s.engines} "
        f"served {s.served} queue {s.gw_queue_premium} reloads {s.gw_reloads}"
    )


def hpa_state(plane: Any) -> str:
    """The HPA's status (conditions and current metrics): why it did or did not scale."""
    status, hpa = plane.request("GET", KHPA)
    return json.dumps(hpa.get("status") if status == 200 else hpa)[:3000]


def settled_at_one(observer: Observer) -> bool:
    s = observer.latest()
    return bool(
        s
        and s.md_replicas == 1
        and s.sts_replicas == 1
        and s.endpoints == 1
        and list(s.engines.values()) == ["ready"]
        and not s.draining
    )


@dataclass
class Cycle:
    start: float
    step: float
    down: float
    end: float
    scale_out: dict[str, float | None]
    scale_in: dict[str, float | None]
    #: Whether the pool was back at one replica at the end (else no further cycle starts).
    settled: bool = True

    def phase(self, name: str) -> tuple[float, float]:
        """When requests of phase ``name`` (steady, scale_out, scale_in) were sent."""
        return {
            "steady": (self.start, self.step),
            "scale_out": (self.step, self.down),
            "scale_in": (self.down, self.end),
        }[name]


def run_cycle(
    args: argparse.Namespace, load: OpenLoop, observer: Observer, rates: tuple[float, float]
) -> Cycle:
    steady, step_rate = rates
    wait_until(
        lambda: settled_at_one(observer),
        "the pool settled at one replica",
        900,
        functools.partial(progress, observer),
    )
    start = time.time()
    load.rate = steady
    say(f"steady load {steady:.2f}/s for {args.steady_seconds} s")
    time.sleep(args.steady_seconds)
    step = time.time()
    load.rate = step_rate
    say(f"load step to {step_rate:.2f}/s")
    show = functools.partial(progress, observer)
    # No HPA decision within --hpa-timeout: the chain is broken (KEDA, Prometheus, the query), not slow.
    wait_until(
        lambda: scale_out_events(observer.samples, step)["hpa"],
        "KEDA's HPA raising spec.pool.replicas",
        args.hpa_timeout,
        show,
        on_timeout=functools.partial(hpa_state, observer.plane),
    )
    try:
        serving = wait_until(
            lambda: scale_out_events(observer.samples, step)["serving"],
            "the second replica serving",
            args.step_timeout,
            show,
        )
        say(f"second replica serving {serving - step:.0f} s after the step; holding {args.hold_seconds} s")
        time.sleep(args.hold_seconds)
    except TimeoutError as exc:
        say(f"no scale-out: {exc}")  # the figures say so (None), and the load goes down all the same
    down = time.time()
    load.rate = steady
    say("load back down")
    wait_until(
        lambda: scale_in_events(observer.samples, down)["hpa"],
        "KEDA's HPA lowering spec.pool.replicas",
        args.hpa_timeout + (args.scale_down_window or 300),
        show,
        on_timeout=functools.partial(hpa_state, observer.plane),
    )
    settled = True
    try:
        wait_until(
            lambda: scale_in_events(observer.samples, down)["pod_gone"],
            "the leaving replica's pod gone",
            args.step_timeout,
            show,
        )
    except TimeoutError as exc:
        say(f"no scale-in: {exc}")
        settled = False
    time.sleep(10)
    end = time.time()
    cycle = Cycle(
        start=start,
        step=step,
        down=down,
        end=end,
        scale_out=scale_out_events(observer.samples, step),
        scale_in=scale_in_events(observer.samples, down),
        settled=settled,
    )
    say(f"scale-out {relative(cycle.scale_out, step)}; scale-in {relative(cycle.scale_in, down)}")
    return cycle


def gateway_log(plane: Any) -> list[str]:
    text = kubectl(
        plane,
        "logs",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/component=gateway",
        "--timestamps",
        "--tail=-1",
        check=False,
    )
    keep = ("WARNING", "ERROR", "healthy", "configuration loaded", "Traceback")
    return [line for line in text.splitlines() if any(k in line for k in keep)][-120:]


def figures_of(
    cycles: Sequence[Cycle], outcomes: Sequence[Outcome], refresh: Sequence[float]
) -> dict[str, Figure]:
    figures: dict[str, Figure] = {}

    def add(key: str, values: Sequence[float | None], unit: str, note: str = "") -> None:
        known = [v for v in values if v is not None]
        if known:
            figures[key] = Figure.of(
                known,
                unit,
                note=note
                if len(known) == len(values)
                else f"{note} ({len(known)} of {len(values)} cycles)".strip(),
            )

    for key, note in (
        ("hpa", "spec.pool.replicas 2"),
        ("pod_ready", "second engine pod Ready"),
        ("table", "tenant table lists it"),
        ("gateway_healthy", "gateway checked it healthy"),
        ("serving", "first request it answered"),
    ):
        add(
            f"scale_out.{key}_s",
            [relative(c.scale_out, c.step)[key] for c in cycles],
            "s",
            f"from the step: {note}",
        )
    for key, note in (
        ("hpa", "spec.pool.replicas 1"),
        ("table", "tenant table drops it"),
        ("gateway_reloaded", "gateway reloaded the table"),
        ("last_answer_on_leaving", "last request the leaving replica answered"),
        ("pod_gone", "its pod gone"),
    ):
        add(
            f"scale_in.{key}_s",
            [relative(c.scale_in, c.down)[key] for c in cycles],
            "s",
            f"from the load going down: {note}",
        )
    add(
        "table_refresh_s",
        list(refresh),
        "s",
        "ConfigMap written to the gateway pod's reload, both directions",
    )
    for phase in ("steady", "scale_out", "scale_in"):
        sent = [outcomes_between(outcomes, *c.phase(phase)) for c in cycles]
        add(f"requests.{phase}", [float(len(x)) for x in sent], "requests")
        add(f"failed.{phase}", [float(sum(o.failed for o in x)) for x in sent], "requests", "target 0")
    figures["failed.total"] = Figure.single(
        float(sum(o.failed for o in outcomes)), "requests", note="every request of the run, target 0"
    )
    figures["requests.total"] = Figure.single(float(len(outcomes)), "requests")
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--cycles", type=int, default=2, help="step/scale-out/scale-in cycles (default 2)")
    parser.add_argument(
        "--drain-seconds", type=int, default=100, help="the chart's operator.scaleInDrainSeconds"
    )
    parser.add_argument(
        "--scale-down-window", type=int, default=180, help="HPA scale-down stabilization (s); 0: default"
    )
    parser.add_argument(
        "--engine-cpu-limit",
        default="700m",
        help="each engine pod's CPU limit ('' for none): the node's 2 cores also run the control plane",
    )
    parser.add_argument(
        "--request-seconds", type=float, default=2.0, help="what one request alone should take"
    )
    parser.add_argument(
        "--steady-load", type=float, default=0.3, help="steady load, in one replica's capacity"
    )
    parser.add_argument(
        "--step-load", type=float, default=1.5, help="the step's load, in one replica's capacity"
    )
    parser.add_argument("--steady-seconds", type=int, default=30)
    parser.add_argument(
        "--hold-seconds", type=int, default=20, help="step load kept after the 2nd replica serves"
    )
    parser.add_argument("--step-timeout", type=float, default=600.0)
    parser.add_argument(
        "--hpa-timeout", type=float, default=240.0, help="no HPA decision within this: stop the run"
    )
    parser.add_argument("--seed", type=int, default=26)
    add_results_argument(parser, NAME)
    args = parser.parse_args(argv)

    blockers = [f"{what} ({command})" for what, command in real_pods_blockers()] + missing_keda()
    if blockers:
        print("cannot run: " + "; ".join(blockers), file=sys.stderr)
        return 2
    loads = [os.getloadavg()[0]]
    started = time.monotonic()
    say("starting the node tier")
    plane = start_control_plane("node", timeout=600)
    keda = prometheus = None
    observer = load = None
    workdir = Path(tempfile.mkdtemp(prefix="kvfleet-bench-autoscaling-"))
    try:
        keda = start_keda(plane)
        say(f"KEDA up in {keda.started_in:.0f} s")
        create_namespace(plane, NS, RESTRICTED)
        create_namespace(plane, MONITORING_NS, RESTRICTED)
        kubeconfig = create_scraper_identity(plane, MONITORING_NS, workdir / "scraper.kubeconfig")
        prometheus = start_prometheus(
            build_pod_discovery_config(kubeconfig, [NS], interval="1s"), binary_names=PROMETHEUS_K8S
        )
        helm_install(
            plane, [NS], values=["rbac.keda=true", f"operator.scaleInDrainSeconds={args.drain_seconds}"]
        )
        provide_model_volume(plane, NS, "kvfleet-bench-autoscaling-models")
        docs = bench_documents(build_example_documents(NS), prometheus.url, args.engine_cpu_limit)
        for doc in docs:
            plural = {"ModelDeployment": "modeldeployments", "Tenant": "tenants"}[doc["kind"]]
            kube(
                plane,
                "PATCH",
                f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/{plural}/{doc['metadata']['name']}"
                "?fieldManager=kvfleet-bench&force=true",
                doc,
                "application/apply-patch+yaml",
            )
        say("waiting for the engine and the gateway")
        wait_for_engine_and_gateway(plane, NS)
        setup_s = time.monotonic() - started
        loads.append(os.getloadavg()[0])
        say(f"serving after {setup_s:.0f} s; waiting for KEDA's HPA")
        wait_until(lambda: plane.request("GET", KHPA)[0] == 200, "the HPA KEDA creates", 300)
        window = args.scale_down_window
        if window:
            kube(plane, "PATCH", f"{KSO}?fieldManager=kvfleet-bench-platform", behavior_patch(window),
                 "application/merge-patch+json")  # fmt: skip

            def hpa_window() -> bool:
                status, hpa = plane.request("GET", KHPA)
                behavior = (hpa.get("spec") or {}).get("behavior") or {} if status == 200 else {}
                return bool(behavior.get("scaleDown", {}).get("stabilizationWindowSeconds") == window)

            wait_until(hpa_window, "KEDA carrying the scale-down window to the HPA", 120)
        url = gateway_service_url(plane, NS, MD)

        def all_keys() -> dict[str, str] | None:
            try:
                return tenant_keys(plane, NS, list(TENANTS))
            except (KeyError, TypeError, KubeError):
                return None  # a tenant whose key Secret the operator has not named yet

        keys: dict[str, str] = wait_until(all_keys, "both premium tenants' API keys", 120)
        (md_doc,) = (d for d in docs if d["kind"] == "ModelDeployment")
        served_name = str(md_doc["spec"]["model"]["servedName"])

        # Calibration: one request alone, sized to --request-seconds.
        first_key = keys[TENANTS[0]]
        complete_once(url, served_name, first_key, 8)  # warm-up
        probe = statistics.median(complete_once(url, served_name, first_key, 64) for _ in range(3))
        max_tokens = max(16, min(1500, round(64 * args.request_seconds / probe)))
        alone = statistics.median(complete_once(url, served_name, first_key, max_tokens) for _ in range(3))
        capacity = IN_FLIGHT_PER_REPLICA / alone
        rates = (args.steady_load * capacity, args.step_load * capacity)
        say(
            f"64 tokens: {probe:.2f} s; {max_tokens} tokens: {alone:.2f} s alone; "
            f"one replica: {capacity:.2f}/s"
        )

        observer = Observer(plane)
        observer.start()
        load = OpenLoop(url, served_name, [(t, keys[t]) for t in TENANTS], max_tokens, args.seed)
        load.start()
        cycles = []
        for i in range(args.cycles):
            say(f"cycle {i + 1} of {args.cycles}")
            cycles.append(run_cycle(args, load, observer, rates))
            loads.append(os.getloadavg()[0])
            if not cycles[-1].settled:
                break
        load.rate = 0.0
        say(f"stopping the load; {load.in_flight} requests in flight")
        load.stop()
        observer.stop()
        so_status, so = plane.request("GET", KSO)
        window_kept = bool(so_status == 200 and ((so.get("spec") or {}).get("advanced") or {}))
        samples = observer.samples
        refresh = []
        for c in cycles:
            for events in (c.scale_out, c.scale_in):
                table, reloaded = events["table"], events["gateway_reloaded"]
                if table is not None and reloaded is not None:
                    refresh.append(round(reloaded - table, 1))
        outcomes = sorted(load.outcomes, key=lambda o: o.sent)
        figures = figures_of(cycles, outcomes, refresh)
        failures = [
            {
                "cycle": next((i + 1 for i, c in enumerate(cycles) if c.start <= o.sent < c.end), None),
                "sent": time.strftime("%H:%M:%S", time.gmtime(o.sent)) + f".{int(o.sent % 1 * 1000):03d}Z",
                "took_s": round(o.done - o.sent, 2),
                "tenant": o.tenant,
                "status": o.status,
                "error": o.error,
            }
            for o in outcomes
            if o.failed
        ]
        queue_peaks = [
            max((s.gw_queue_premium or 0.0) for s in samples if c.step <= s.t < c.down) for c in cycles
        ]
        figures["scale_out.queue_peak"] = Figure.of(
            queue_peaks, "requests", note="premium requests held at the gateway"
        )
        waits = [
            o.done - o.sent
            for c in cycles
            for o in outcomes_between(outcomes, c.step, c.down)
            if not o.failed
        ]
        if waits:
            figures["scale_out.latency_p99_s"] = Figure.single(
                round(statistics.quantiles(waits, n=100)[98], 1),
                "s",
                note="requests sent during the step, queue included",
            )
        details: dict[str, Any] = {
            "settings": {
                "cycles": args.cycles,
                "scale_in_drain_seconds": args.drain_seconds,
                "hpa_scale_down_window_s": window or "default (300)",
                "scale_down_window_patch_kept": window_kept,
                "premium_queue_per_replica": PREMIUM_PER_REPLICA,
                "engine_in_flight_per_replica": IN_FLIGHT_PER_REPLICA,
                "queue_timeout": QUEUE_TIMEOUT,
                "engine_cpu_request": ENGINE_CPU_REQUEST,
                "engine_cpu_limit": args.engine_cpu_limit or "none",
                "gateway_cpu_request": GATEWAY_CPU_REQUEST,
                "keda_polling_interval_s": 2,
                "hpa_sync_period_s": 3,
                "prometheus_scrape_interval_s": 1,
                "max_tokens": max_tokens,
                "request_alone_s": round(alone, 2),
                "one_replica_capacity_per_s": round(capacity, 3),
                "steady_rate_per_s": round(rates[0], 3),
                "step_rate_per_s": round(rates[1], 3),
                "setup_s": round(setup_s, 0),
                "tenants": list(TENANTS),
            },
            "cycles": [
                {
                    "scale_out_from_step_s": relative(c.scale_out, c.step),
                    "scale_in_from_down_s": relative(c.scale_in, c.down),
                    "step_s": round(c.down - c.step, 0),
                }
                for c in cycles
            ],
            "table_refresh_s": refresh,
            "failures": failures[:200],
            "gateway_log": gateway_log(plane),
            "gateway_upstream_errors": samples[-1].gw_upstream_errors if samples else None,
            "wall_s": round(time.monotonic() - started, 0),
        }
        path = write_results(
            measured(
                name_of(args.results),
                command_line(prefix="PYTHONPATH=hack"),
                figures,
                Machine.over_phases(loads),
                details,
            ),
            args.results,
        )
        say(f"wrote {path}; {len(failures)} failed requests of {len(outcomes)}")
        return 0
    finally:
        if load is not None:
            load.rate = 0.0
            load.stop()
        if observer is not None:
            observer.stop()
            keep = os.environ.get("KVFLEET_BENCH_SAMPLES")  # every sample and outcome, for a closer look
            if keep:
                kept = {"samples": [asdict(x) for x in observer.samples]}
                kept["outcomes"] = [asdict(o) for o in load.outcomes] if load is not None else []
                Path(keep).write_text(json.dumps(kept))
        if prometheus is not None:
            prometheus.stop()
        if keda is not None:
            keda.stop()
        plane.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
